"""The benchmarks' harness: flags, model resolution, our engine, workloads, timing, the command.

Every benchmark compares systems inside one process and one run, and reports ratios: on a shared
machine absolute numbers drift, ratios measured side by side drift much less. What they print and
write (machine and load lines, tables, ratios, JSON) is bench/report.py.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import report

DEFAULT_THREADS = 2


def default_cache_dir() -> Path:
    """Where the converted demo model lives: $DEJA_CACHE_DIR, else ~/.cache/deja."""
    return Path(os.environ.get("DEJA_CACHE_DIR") or Path.home() / ".cache" / "deja")


def add_common_arguments(parser: argparse.ArgumentParser, dtype: str = "float32") -> None:
    """Flags every benchmark takes (`dtype`: the benchmark's default --dtype)."""
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (SmolLM2-135M-Instruct), 'tiny' (a 2-layer random Llama) or a local HF folder",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder of the converted demo model (default: $DEJA_CACHE_DIR or ~/.cache/deja)",
    )
    parser.add_argument("--dtype", default=dtype, choices=("float32", "float16", "bfloat16"))
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
    add_json_argument(parser)
    parser.add_argument(
        "--quick", action="store_true", help="a few short requests (smoke test), not a measurement"
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """--json PATH: where `report.write_json` writes the results."""
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write results here"
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
    the benchmark has that flag and it is given (not None or 0); a MIN MAX pair becomes a tuple."""
    work: dict[str, Any] = {}
    for key, value in (quick if args.quick else full).items():
        given = getattr(args, key, None) or value
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


def begin(args: argparse.Namespace, title: str) -> tuple[str, dict[str, Any]]:
    """What a benchmark on our CPU engine does first: torch set up (--threads), the model
    resolved (--model, --cache-dir), the machine recorded and the header printed. Returns the
    model folder and the machine info (`report.finish_info` adds the load at the end)."""
    setup_torch(args.threads)
    model_path = resolve_model(args.model, args.cache_dir)
    info = report.machine_info(args.threads)
    report.print_header(title, model_path, info)
    return model_path, info


TINY = "tiny"
"""--model tiny: a random Llama (2 layers, hidden 64, engine/testing/tiny_models.py), where a step's time is
mostly the engine's host work."""


def resolve_model(model: str, cache_dir: Path | None) -> str:
    """'demo' -> the converted demo folder (converted on first use); 'tiny' -> the tiny random
    Llama (built once, seed 0); else an existing folder."""
    from engine.demo import resolve_model_path

    cache = cache_dir or default_cache_dir()
    if model == TINY:
        from engine.testing.tiny_models import build_tiny_llama

        out = cache / "tiny-llama-seed0"
        if not (out / "config.json").exists():
            build_tiny_llama(out)
        return str(out)
    return resolve_model_path(model, cache)


def our_llm(model_path: str, args: argparse.Namespace, **options: Any) -> Any:
    """Our engine (engine.LLM) with the common flags' --dtype and --max-num-batched-tokens, on
    the CPU unless `options` (further LLM keyword arguments) name another device."""
    from engine import LLM

    config = {"dtype": args.dtype, "device": "cpu", **options}
    return LLM(model_path, max_num_batched_tokens=args.max_num_batched_tokens, **config)


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


@dataclass(slots=True)
class SystemResult:
    """One system's run of a whole workload (`deja bench offline`)."""

    name: str
    seconds: float
    """Wall-clock seconds of the whole workload."""
    cpu_seconds: float
    """CPU seconds of the process meanwhile (all threads)."""
    useful_tokens: int
    """Output tokens the requests asked for (padding and overrun of static batches excluded)."""
    computed_tokens: int
    """Output tokens actually generated (a static batch runs every row to its longest output)."""
    outputs: list[list[int]] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.useful_tokens / self.cpu_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "tokens_per_cpu_s": self.tokens_per_cpu_s,
            "useful_output_tokens": self.useful_tokens,
            "computed_output_tokens": self.computed_tokens,
            "tokens_per_s": self.tokens_per_s,
        }


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
    argv: list[str] | None = None,
) -> int:
    """A benchmark's command line (`python -m bench.NAME`): its flags parsed from argv, then
    `run`."""
    return run(parse_args(add_arguments, argv, prog, doc))
