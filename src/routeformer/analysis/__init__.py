"""Analysis of trained models (``routeformer analyze``): what each approximation of attention loses
(``substitution``, ``approximate``), how heads differ (``divergence``), what routing attends to (``patterns``)."""

from .approximate import METHODS, HeadApproximation, Method, approximate, ova_weights, project_simplex
from .heads import HeadCall, PairValues, capture, check_layers, hooked
from .substitution import ApproximationResult, Substitute, approximation_table, methods_for

__all__ = [
    "METHODS",
    "ApproximationResult",
    "HeadApproximation",
    "HeadCall",
    "Method",
    "PairValues",
    "Substitute",
    "approximate",
    "approximation_table",
    "capture",
    "check_layers",
    "hooked",
    "methods_for",
    "ova_weights",
    "project_simplex",
]
