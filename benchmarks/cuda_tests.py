#!/usr/bin/env python
"""Every CUDA-marked test, one pytest process per test file, the files in parallel (issue 26, item 5).

    python benchmarks/cuda_tests.py                  # all files that hold a CUDA-marked test
    python benchmarks/cuda_tests.py --jobs 4 --timeout 80
    python benchmarks/cuda_tests.py tests/test_gpu_step.py tests/optim/test_fused.py

Why parallel: most of the CUDA tests' time is Inductor compiling fused optimizer steps (about 10 s
per configuration on an H200), which is host work. One ``pytest -m cuda`` over all files ran past
90 s on an H200 (torch 2.11, 2026-11-27) after two tests; the files are independent, so they run
side by side (a GPU machine has 16 cores) and the wall time is the slowest file's.

Each file's result is printed when it finishes (its summary line, its seconds, and the output's
tail when it failed); a file still running at ``--timeout`` is killed and named. Exit status: 0
when every file passed (or skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cuda_test_files(root: Path = ROOT) -> list[Path]:
    """The test files under ``root / "tests"`` that mark a test ``cuda`` (``pytest.mark.cuda``), sorted."""
    return sorted(p for p in (root / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text(encoding="utf-8"))


def _summary(output: str) -> str:
    """pytest's last summary line ("3 passed, 1 skipped in 4.2s"), or the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(w in line for w in (" passed", " failed", " skipped", " error", "no tests ran")):
            return line.strip("= ")
    return lines[-1] if lines else "(no output)"


def _has_cuda() -> bool:
    """Whether torch sees a CUDA device (imported here only: the runner itself needs no torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="test files (default: every file with a CUDA-marked test)")
    ap.add_argument("--jobs", type=int, default=8, help="files run at once (default 8)")
    ap.add_argument("--timeout", type=float, default=80.0, help="seconds for all files together (default 80)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs: at least 1, got {args.jobs}")
    files = [Path(f) for f in args.files] or cuda_test_files()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    # Each process's Inductor would start a compile pool as wide as the machine: share the cores instead.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, min(args.jobs, len(files))))))
    if not _has_cuda():
        print("cuda_tests: NO CUDA DEVICE here: every CUDA-marked test skips itself, so the files below pass without "
              "checking anything on a GPU", flush=True)
    print(f"cuda_tests: {len(files)} files, {args.jobs} at a time, {args.timeout:.0f} s", flush=True)
    t0 = time.perf_counter()
    waiting = list(files)
    # Output to files, not pipes: a file's long failure output must not block it on a full pipe.
    logs = Path(tempfile.mkdtemp(prefix="cuda_tests_"))
    running: dict[Path, tuple[subprocess.Popen[bytes], float, Path]] = {}
    failed: list[str] = []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            f = waiting.pop(0)
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(f)]
            log = logs / f"{len(running)}_{f.stem}_{time.monotonic_ns()}.txt"
            with log.open("wb") as sink:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
            running[f] = (proc, time.perf_counter(), log)
        done = [f for f, (proc, _, _) in running.items() if proc.poll() is not None]
        for f in done:
            proc, start, log = running.pop(f)
            out = log.read_text(encoding="utf-8", errors="replace")
            # pytest's exit 5: no test selected in the file (every CUDA test deselected): not a failure.
            ok = proc.returncode in (0, 5)
            print(f"{'ok    ' if ok else 'FAILED'} {f}: {_summary(out)} [{time.perf_counter() - start:.1f} s]", flush=True)
            if not ok:
                failed.append(str(f))
                print("\n".join(out.splitlines()[-40:]), flush=True)
        if time.perf_counter() - t0 > args.timeout:
            for f, (proc, _, _) in running.items():
                proc.kill()
                print(f"KILLED {f}: still running at {args.timeout:.0f} s", flush=True)
                failed.append(str(f))
            running.clear()
            for f in waiting:
                print(f"NOT RUN {f}", flush=True)
                failed.append(str(f))
            waiting.clear()
        if running and not done:
            time.sleep(0.2)
    print(f"cuda_tests: {len(files) - len(failed)} of {len(files)} files passed in {time.perf_counter() - t0:.1f} s",
          flush=True)
    shutil.rmtree(logs, ignore_errors=True)  # every log worth reading was printed above
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
