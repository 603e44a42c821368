"""``routeformer analyze RUN_DIR approximations | heads | patterns | routing | copying``: each reads a run
directory, analyses its model on a split of its data set and writes a text table, a CSV and (most) PNG figures (by
default under RUN_DIR/analysis), printing the table and the paths."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..data import Dataset, eval_windows
from ..durable import atomic_write
from ..train.evaluation import UNITS
from ..train.runs import load_run, pick_device
from .approximate import METHODS
from .divergence import format_divergences, head_divergences, write_divergence_csv
from .figures import plot_approximations, plot_cluster_sizes, plot_divergences, plot_patterns
from .heads import check_layers
from .patterns import cluster_stats, format_cluster_stats, head_patterns
from .substitution import Substitute, approximation_table, format_table, methods_for, write_csv


@dataclass
class Target:
    """What every analysis needs: the run's model (evaluation mode), its data split, where to write, and names."""

    model: torch.nn.Module
    data: Dataset
    tokens: np.ndarray  # the split
    out: Path
    label: str  # 'RUN_DIR (best weights, valid split of stdlib)'

    @property
    def kind(self) -> str:
        """The data's kind ('bytes', 'words', 'images'), which names the metric."""
        return self.data.meta.kind

    @property
    def unit(self) -> str:
        return UNITS[self.kind]


def open_target(run_dir: str | Path, *, split: str = "valid", checkpoint: str = "best", data_dir: str | None = None,
                device: str = "auto", out: str | Path | None = None) -> Target:
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist: give a run directory written by routeformer train")
    model, _, data, which = load_run(run_dir, checkpoint, data_dir, pick_device(device))
    refuse_encoder_decoder(model, run_dir)
    tokens = data.split(split)
    if len(tokens) < 2:
        raise ValueError(f"the {split} split of {data.meta.name!r} is too short to analyse")
    out_dir = Path(out).expanduser() if out is not None else run_dir / "analysis"
    out_dir.mkdir(parents=True, exist_ok=True)
    label = f"{run_dir.name} ({which} weights, {split} split of {data.meta.name})"
    return Target(model, data, tokens, out_dir, label)


def refuse_encoder_decoder(model: object, run_dir: Path) -> None:
    """The analyses read a language model's heads over its own text: an encoder-decoder run is refused by name."""
    from ..model.seq2seq import Seq2SeqLM

    if isinstance(model, Seq2SeqLM):
        raise ValueError(f"{run_dir} is an encoder-decoder run: this analysis reads language-model runs (their heads "
                         f"over their own text); 'analyze RUN_DIR routing', evaluate and sample take it")


def is_encoder_decoder_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds an encoder-decoder run (its config.toml has [encoder]); False where it holds no
    run (``open_target`` names the problem)."""
    from ..train.runs import read_run_config
    from ..train.seq2seq_config import Seq2SeqRun

    run_dir = Path(run_dir).expanduser()
    return (run_dir / "config.toml").is_file() and isinstance(read_run_config(run_dir), Seq2SeqRun)


def seq2seq_routing(run_dir: str | Path, *, split: str = "valid", checkpoint: str = "best",
                    data_dir: str | None = None, device: str = "auto", out: str | Path | None = None,
                    pairs: int = 256, local_window: int | None = None) -> list[Path]:
    """What an encoder-decoder run's routing heads read (``seq2seq.routed_reading``) over ``pairs`` pairs of the
    split, evenly spaced; ``local_window`` (default the encoder's local heads' widest window) for the encoder
    groups' mass beyond it. Writes a text table and a CSV; returns their paths."""
    from ..data import read_pairs
    from .seq2seq import format_reading, routed_reading

    run_dir = Path(run_dir).expanduser()
    model, _, data, which = load_run(run_dir, checkpoint, data_dir, pick_device(device))
    chosen = read_pairs(data, split)
    if not chosen:
        raise ValueError(f"the {split} split of {data.meta.name!r} holds no pairs")
    chosen = [chosen[int(i)] for i in np.unique(np.linspace(0, len(chosen) - 1, min(pairs, len(chosen))).round())]
    groups = [g for block in model.encoder for g in block.attention.groups]
    window = local_window or max((g.band for g in groups if g.band is not None), default=None)
    rows = routed_reading(model, chosen, window)
    if not rows:
        raise ValueError(f"{run_dir}: neither the encoder nor the cross-attention has routing heads")
    out_dir = Path(out).expanduser() if out is not None else run_dir / "analysis"
    out_dir.mkdir(parents=True, exist_ok=True)
    label = (f"{run_dir.name} ({which} weights, {len(chosen)} pairs of the {split} split of {data.meta.name}; "
             f"local window {window})")
    table = format_reading(rows, label)
    print(table)
    text, csv = out_dir / "routing_reading.txt", out_dir / "routing_reading.csv"
    _write_text(text, table)
    _write_text(csv, "stack,layer,first_head,heads,keys_read,keys_there,recall,beyond\n" + "\n".join(
        f"{r.stack},{r.layer},{r.heads.start},{len(r.heads)},{r.keys:.4f},{r.available:.4f},{r.recall:.6f},"
        f"{'' if r.beyond is None else f'{r.beyond:.6f}'}" for r in rows))
    return [text, csv]


def parse_ints(text: str, what: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; a ValueError naming ``what`` for anything but positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}")
    return sorted(set(values))


def parse_layers(text: str | None, model) -> list[int] | None:
    """'0,2' -> [0, 2] after checking they exist (None: every layer)."""
    if text is None:
        return None
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated layer numbers, got {text!r}") from None
    return check_layers(model, layers)


def sample_windows(tokens: np.ndarray, seq_len: int, count: int, batch: int) -> list[torch.Tensor]:
    """``count`` evenly spaced non-overlapping windows of the split, as (b, seq_len) token batches of ``batch``."""
    starts = [s for s, _ in eval_windows(len(tokens), seq_len) if s + seq_len <= len(tokens)]
    if not starts:
        raise ValueError(f"the split holds fewer than seq_len = {seq_len} tokens")
    pick = np.unique(np.linspace(0, len(starts) - 1, min(count, len(starts))).round().astype(int))
    rows = [torch.from_numpy(np.asarray(tokens[starts[i]:starts[i] + seq_len], dtype=np.int64)) for i in pick]
    return [torch.stack(rows[i:i + batch]) for i in range(0, len(rows), batch)]


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n"))


def approximations(target: Target, *, methods: list[str], rs: list[int], layers: list[int] | None = None,
                   windows: int | None = 32, batch: int = 8, lsh_rounds: int = 1, seed: int = 0) -> list[Path]:
    """The approximation table of ``target`` (see ``substitution.py``); returns the files written."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    model = target.model
    chosen_layers = range(len(model.blocks)) if layers is None else layers
    kernels = {g.kernel for i in chosen_layers for g in model.blocks[i].attention.groups}
    chosen = methods_for(methods, rs, features_ok=kernels == {"exp"})
    if "features" in methods and kernels != {"exp"}:
        print(f"random features skipped: they estimate the exponential kernel only (this model: "
              f"{', '.join(sorted(kernels))})")
    from tqdm import tqdm

    # One bar over the methods (each an evaluation of the windows) on stderr, like training's and evaluate's; each
    # method's line still goes to stdout, written above the bar.
    bar = tqdm(total=len(chosen), desc="approximations", unit="method", dynamic_ncols=True, mininterval=1.0,
               leave=False, file=sys.stderr)

    def progress(line: str) -> None:
        bar.write(f"  {line}", file=sys.stdout)
        sys.stdout.flush()
        bar.update()

    try:
        own, results = approximation_table(model, target.tokens, target.kind, chosen, batch=batch,
                                           max_windows=windows, how=Substitute(layers, lsh_rounds, seed),
                                           progress=progress)
    finally:
        bar.close()
    D = model.config.head_dim
    scope = "every layer" if layers is None else f"layers {', '.join(map(str, layers))}"
    header = (f"{target.label}: every head of {scope} replaced at once; "
              f"{'all' if windows is None else windows} windows of {model.config.seq_len} tokens; head size D = {D} "
              f"(optimal-v-aware is exact for r = 1 and r >= {D + 1}; between, an upper bound on the optimum)")
    table = header + "\n" + format_table(own, results, target.unit)
    print(table)
    text, csv, png = (target.out / f"approximations.{ext}" for ext in ("txt", "csv", "png"))
    _write_text(text, table)
    write_csv(results, csv, target.unit)
    written = [text, csv]
    if plot_approximations(own, results, target.unit, png, target.label):
        written.append(png)
    return written


def heads(target: Target, *, layers: list[int] | None = None, batches: int = 4, batch: int = 4) -> list[Path]:
    """Jensen-Shannon divergences between the heads of each layer (``divergence.py``)."""
    model = target.model
    windows = sample_windows(target.tokens, model.config.seq_len, batches * batch, batch)
    results = head_divergences(model, windows, layers)
    table = (f"{target.label}: Jensen-Shannon divergence (nats, at most ln 2 = 0.693) between the attention "
             f"distributions of pairs of heads, exact and dense at N = {model.config.seq_len}; mean ± std over "
             f"{len(windows)} batches of {batch} windows\n" + format_divergences(results))
    print(table)
    text, csv, png = (target.out / f"heads.{ext}" for ext in ("txt", "csv", "png"))
    _write_text(text, table)
    write_divergence_csv(results, csv)
    written = [text, csv]
    if plot_divergences(results, png):
        written.append(png)
    return written


def patterns(target: Target, *, layer: int = 0, head: int | None = None, text: bytes | None = None,
             length: int | None = None, batches: int = 4, batch: int = 4) -> list[Path]:
    """Figure-1 pictures of ``layer`` (one ``head`` or all) on ``text`` (default: the split's first window), and
    the cluster statistics of every routing head over ``batches`` of windows."""
    model = target.model
    seq_len = model.config.seq_len
    n = seq_len if length is None else length
    if not 1 <= n <= seq_len:
        raise ValueError(f"--length must be in [1, seq_len = {seq_len}], got {n}")
    ids = target.data.encode(text)[:n] if text is not None else np.asarray(target.tokens[:n], dtype=np.int64)
    pats = head_patterns(model, torch.from_numpy(ids), layer, head)
    name = f"patterns-layer{layer}" + ("" if head is None else f"-head{head}")
    png = target.out / f"{name}.png"
    written = []
    drawn = plot_patterns(pats, png, f"{target.label}: {len(ids)} tokens; rows = outputs, columns = inputs"
                          " (routing heads coloured by the query's cluster)")
    if not drawn:
        raise ValueError("patterns draws pictures with matplotlib: pip install matplotlib (or routeformer[plot])")
    written.append(png)
    windows = sample_windows(target.tokens, seq_len, batches * batch, batch)
    stats = cluster_stats(model, windows)
    table = (f"{target.label}: routing heads over {sum(len(w) for w in windows)} windows of {seq_len} tokens "
             f"(sizes: positions per cluster per window, by their queries' clusters; balance: largest / mean; "
             f"captured: share of full attention's mass on the routed keys)\n" + format_cluster_stats(stats))
    print(table)
    text_path = target.out / "clusters.txt"
    _write_text(text_path, table)
    written.append(text_path)
    if stats and plot_cluster_sizes(stats, target.out / "clusters.png"):
        written.append(target.out / "clusters.png")
    return written


def local_window_of(model) -> int | None:
    """The widest band of the model's content-independent heads (``HeadGroup.band``: local attention's window);
    None when it has none."""
    bands = [g.band for block in model.blocks for g in block.attention.groups if g.band is not None]
    return max(bands, default=None)


class Baseline(NamedTuple):
    """A run to compare with: its directory, which of its weights, and where its data lives (None: its own)."""

    directory: str | Path
    checkpoint: str = "best"
    data_dir: str | None = None


def routing(target: Target, baseline: Baseline | None = None, *, windows: int = 16, batch: int = 4,
            top: int = 100, context: int = 8, local_window: int | None = None) -> list[Path]:
    """What the routing heads of ``target`` use (``routing.routing_use``) and, given a ``baseline`` run on the same
    data and length, where the model's per-token loss beats it (``routing.loss_by_recurrence``)."""
    from ..train.sampling import decode
    from . import routing as study

    model = target.model
    n = model.config.seq_len
    window = local_window or local_window_of(model)
    if window is None:
        raise ValueError("the model has no local heads: give --local-window W, the distance that counts as far")
    if not 1 <= window < n:
        raise ValueError(f"--local-window must be in [1, seq_len = {n}), got {window}")
    if not any(g.num_clusters is not None for block in model.blocks for g in block.attention.groups):
        raise ValueError(f"{target.label}: the model has no routing heads ({model.config.describe_heads()})")
    other = None
    if baseline is not None:
        base_dir = Path(baseline.directory).expanduser()
        if not base_dir.is_dir():
            raise FileNotFoundError(f"--baseline {base_dir} does not exist: give a run directory")
        other, _, data, _ = load_run(base_dir, baseline.checkpoint, baseline.data_dir,
                                     next(model.parameters()).device)
        refuse_encoder_decoder(other, base_dir)
        other.eval()
        if data.meta.name != target.data.meta.name or other.config.seq_len != n:
            raise ValueError(f"--baseline {base_dir}: trained on {data.meta.name!r} at seq_len "
                             f"{other.config.seq_len}; the analysed run: {target.data.meta.name!r} at {n}")
    chosen = sample_windows(target.tokens, n + 1, windows, batch)  # (b, N + 1): inputs and the next tokens
    use = study.routing_use(model, [w[:, :-1] for w in chosen], window, top=top, context=context)
    vocab = target.data.vocab()

    def show(pair, position: int) -> str:
        row = chosen[pair.batch][pair.row]
        text = decode(row[max(0, position - 40):position + 1].tolist(), target.kind, vocab)
        return text.replace("\n", "⏎").replace("\t", "⇥").replace("`", "'").replace("|", "¦")

    header = (f"{target.label}: routing heads over {sum(len(w) for w in chosen)} windows of {n} tokens; local "
              f"window {window}; mass = mean attention weight per query (rows sum to 100%)")
    clusters = format_cluster_stats(cluster_stats(model, [w[:, :-1] for w in chosen]))
    table = (header + "\n\n" + study.format_use(use, show) + "\n\nClusters (sizes: positions per cluster per "
             "window; balance: largest / mean; captured: share of full attention's mass on the routed keys)\n"
             + clusters)
    written = []
    if other is not None:
        rows = study.loss_by_recurrence(model, other, chosen, use.edges, context=context)
        table += (f"\n\nPer-token loss against the baseline {base_dir.name} on the same windows, by the "
                  f"distance to the previous occurrence of the last {context} tokens in the window\n"
                  + study.format_recurrence(rows, context, "bits"))
        csv = target.out / "routing-recurrence.csv"
        _write_text(csv, "low,high,positions,loss_bits,baseline_bits,better_share\n" + "\n".join(
            f"{r.low},{r.high},{r.positions},{r.loss:.6f},{r.baseline:.6f},{r.better:.6f}" for r in rows))
        written.append(csv)
        png = target.out / "routing-recurrence.png"
        from .figures import plot_recurrence

        if plot_recurrence(rows, png, f"{target.label} against {base_dir.name}"):
            written.append(png)
    print(table)
    text = target.out / "routing.txt"
    _write_text(text, table)
    return [text, *written]


def copying(target: Target, *, lengths: list[int] | None = None, windows: int = 32, batch: int = 4) -> list[Path]:
    """The loss of ``target`` on windows read a second time against the first reading (``copying.copy_gain``),
    for repeat lengths ``lengths`` (default seq_len / 4 and seq_len / 2)."""
    from .copying import copy_gain, format_copying

    n = target.model.config.seq_len
    lengths = lengths if lengths is not None else sorted({max(2, n // 4), max(2, n // 2)})
    chosen = sample_windows(target.tokens, n + 1, windows, batch)
    rows = copy_gain(target.model, chosen, lengths)
    table = (f"{target.label}: each of {rows[0].windows} windows cut to its first L tokens and repeated to seq_len "
             f"{n}; loss on the first reading (its predictions 1..L-1) and on the repeat (L..{n})\n\n"
             + format_copying(rows))
    print(table)
    text, csv = target.out / "copying.txt", target.out / "copying.csv"
    _write_text(text, table)
    _write_text(csv, "length,first_bits,repeat_bits,windows\n" + "\n".join(
        f"{r.length},{r.first:.6f},{r.repeat:.6f},{r.windows}" for r in rows))
    return [text, csv]
