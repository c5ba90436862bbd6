"""Helpers shared by the benchmarks: model resolution, workloads, timing, tables and JSON output.

Every benchmark compares systems inside one process and one run, and reports ratios: on a shared
machine absolute numbers drift, ratios measured side by side drift much less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_THREADS = 2


def default_cache_dir() -> Path:
    """Where the converted demo model lives: $DEJA_CACHE_DIR, else ~/.cache/deja."""
    return Path(os.environ.get("DEJA_CACHE_DIR") or Path.home() / ".cache" / "deja")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every benchmark takes."""
    parser.add_argument(
        "--model", default="demo", help="'demo' (SmolLM2-135M-Instruct) or a local HF folder"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder of the converted demo model (default: $DEJA_CACHE_DIR or ~/.cache/deja)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="our engine's token budget per step",
    )
    parser.add_argument(
        "--num-device-blocks",
        type=int,
        default=None,
        help="our engine's KV blocks (default: 1 GiB)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write results here"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few short requests (smoke test), not a measurement"
    )


def add_num_requests_argument(parser: argparse.ArgumentParser, full: int, quick: int) -> None:
    """--num-requests, unset (None) meaning the workload's `full` (or `quick`) count."""
    parser.add_argument(
        "--num-requests", type=int, default=None, help=f"default {full} ({quick} with --quick)"
    )


def add_range_argument(
    parser: argparse.ArgumentParser, flag: str, what: str, default: tuple[int, int]
) -> None:
    """`flag MIN MAX`: lengths drawn uniformly from an inclusive range; unset (None) meaning
    `default`."""
    parser.add_argument(
        flag,
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help=f"{what}, uniform, inclusive (default {default[0]} {default[1]})",
    )


def resolve_workload(
    args: argparse.Namespace, full: dict[str, Any], quick: dict[str, Any]
) -> dict[str, Any]:
    """`quick` (with --quick) or `full`, each entry replaced by the flag of the same name when
    that is given (not None or 0); a MIN MAX pair becomes a tuple."""
    work: dict[str, Any] = {}
    for key, value in (quick if args.quick else full).items():
        given = getattr(args, key) or value
        work[key] = tuple(given) if isinstance(given, list) else given
    return work


def setup_torch(threads: int) -> None:
    """Fixes the thread count (before any model is loaded) and silences HF progress output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def resolve_model(model: str, cache_dir: Path | None) -> str:
    """'demo' -> the converted demo folder (converted on first use); else an existing folder."""
    from engine.demo import resolve_model_path

    return resolve_model_path(model, cache_dir or default_cache_dir())


def cpu_llm(model_path: str, args: argparse.Namespace, **options: Any) -> Any:
    """Our engine (engine.LLM) on the CPU with the common flags' --dtype and
    --max-num-batched-tokens; `options` are further LLM keyword arguments."""
    from engine import LLM

    return LLM(
        model_path,
        dtype=args.dtype,
        device="cpu",
        max_num_batched_tokens=args.max_num_batched_tokens,
        **options,
    )


def allowed_token_ids(model_path: str) -> tuple[list[int], int]:
    """Token ids a random prompt may use (the vocabulary minus special and added tokens).

    Returns (ids, vocab_size) where vocab_size is the model's.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    vocab_size = int(config.vocab_size)
    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    # NOTE: the tokenizer may be smaller than the embedding; stay inside both.
    limit = min(vocab_size, len(tok))
    return [t for t in range(limit) if t not in special], vocab_size


def random_prompt(rng: random.Random, ids: Sequence[int], length: int) -> list[int]:
    return [ids[rng.randrange(len(ids))] for _ in range(length)]


@dataclass(frozen=True, slots=True)
class Request:
    """One benchmark request: a prompt of token ids and how many tokens to generate."""

    prompt: list[int]
    max_tokens: int


def make_requests(
    seed: int,
    ids: Sequence[int],
    num: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
) -> list[Request]:
    """`num` requests with lengths uniform in the (inclusive) ranges, from a fixed seed."""
    rng = random.Random(seed)
    lengths = [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num)]
    return [Request(random_prompt(rng, ids, p), o) for p, o in lengths]


@dataclass(slots=True)
class Timing:
    wall: float = 0.0
    """Elapsed wall-clock seconds."""
    cpu: float = 0.0
    """CPU seconds of this process (all threads). On a shared machine it moves less than wall
    time, but it also counts threads spinning in wait."""


@contextmanager
def timed() -> Iterator[Timing]:
    """`with timed() as t: ...` then t.wall and t.cpu hold the elapsed seconds."""
    t = Timing()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield t
    finally:
        t.wall = time.perf_counter() - wall
        t.cpu = time.process_time() - cpu


def p50(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> None:
    """A plain left-aligned text table (floats with `digits` decimals)."""

    def fmt(v: Any) -> str:
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def machine_info(threads: int) -> dict[str, Any]:
    """What the figures were measured on."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_avg_at_start": load_avg(),
    }


def load_avg() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def format_load(values: Sequence[float]) -> str:
    """Load averages as the report lines print them: "0.52, 0.61, 0.70"."""
    return ", ".join(f"{x:.2f}" for x in values)


def finish_info(info: dict[str, Any]) -> str:
    """Records the load average at the end in `info`; returns a line saying whether the machine
    was busy with other work during the run (the figures are then noisier)."""
    end = load_avg()
    info["load_avg_at_end"] = end
    busy = bool(end) and end[1] > (os.cpu_count() or 1) + 0.5
    load = format_load(end)
    note = " (busy with other work: figures are noisy)" if busy else ""
    return f"load avg at end {load}{note}"


def finish_line(info: dict[str, Any]) -> str:
    """`finish_info`'s line, with the load average at the start (`info["load_avg_at_start"]`)."""
    return f"{finish_info(info)} (at start {format_load(info['load_avg_at_start'])})"


def print_header(title: str, model_path: str, info: dict[str, Any]) -> None:
    print(f"== {title} ==")
    print(f"model: {model_path}")
    load = format_load(info["load_avg_at_start"])
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), transformers {info['transformers']}, load avg {load}"
    )


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"results written to {path}")


def parse_args(
    add_arguments: Callable[[argparse.ArgumentParser], None],
    argv: list[str] | None,
    prog: str | None = None,
    doc: str | None = None,
) -> argparse.Namespace:
    """argv parsed with a benchmark's flags (`add_arguments`); `doc`'s first line describes it."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0] if doc else None)
    add_arguments(parser)
    return parser.parse_args(argv)


def main(
    prog: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None,
) -> int:
    """A benchmark's command line: its flags parsed from argv, then `run`."""
    return run(parse_args(add_arguments, argv, prog, doc))
