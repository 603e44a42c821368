"""Data sets: prepared once into memory-mapped train/valid/test arrays + meta.json, then sampled."""

from .gettext import read_pairs
from .loader import BatchSampler, eval_windows, window_batches
from .packing import PackedRows, Rows, first_fit
from .repeats import RepeatCurriculum
from .sources import PREPARERS, prepare, prepare_builtin
from .store import SPLITS, DataError, Dataset, DatasetMeta, default_data_dir

__all__ = ["PREPARERS", "SPLITS", "BatchSampler", "DataError", "Dataset", "DatasetMeta", "PackedRows",
           "RepeatCurriculum", "Rows", "default_data_dir", "first_fit",
           "eval_windows", "prepare", "prepare_builtin", "read_pairs", "window_batches"]
