"""The dependency lock: rewrite it from the newest releases, or test against them.

    .venv/bin/python tools/lock.py update   # `make lock`: rewrite constraints.txt (then make test)
    .venv/bin/python tools/lock.py latest   # `make test-latest`: the default suite on the newest
                                            # releases, in a throwaway venv; not gating

`constraints.txt` pins every package `make demo`, `make test` and CI install (the whole
resolved set, not only the names in requirements*.txt), so a fresh clone gets what was
tested. Both commands resolve the unpinned names of requirements.txt and
requirements-dev.txt in a throwaway venv, with torch held at 2.13.0 (the CPU build on local
disk; any other torch spec can pull a multi-GB CUDA build).

`latest` reuses the project's built C++ core instead of compiling it again: the throwaway
venv gets the project venv's editable-install files (a .pth naming src/ and the dist-info
with the entry points), which is valid because both venvs hold the same torch. It prints the
upgrades against the lock, the suite's result, and for each failing test the upgrade that
breaks it: the failing tests are rerun with one upgraded package at a time put back at its
locked version, and a test that passes then is charged to that upgrade.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
REQUIREMENTS = (ROOT / "requirements.txt", ROOT / "requirements-dev.txt")
TORCH = "torch==2.13.0"
HEADER = """\
# The lock: every package `make demo`, `make test` and CI install, at the version they were
# tested with. Rewritten by `make lock` (tools/lock.py update); do not edit by hand.
# torch 2.13.0 CPU comes from local disk; any other torch spec can pull a multi-GB CUDA build.
"""
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names() -> list[str]:
    """The names requirements*.txt ask for, without their pins or -r/-c lines."""
    names: list[str] = []
    for path in REQUIREMENTS:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            match = _NAME.match(line)
            if line and not line.startswith("-") and match:
                names.append(match.group(1))
    return list(dict.fromkeys(names))


def read_pins(text: str) -> dict[str, str]:
    """{canonical name: version} of `name==version` lines (a torch local label dropped)."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.split("+", 1)[0].strip()
    return pins


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw)


def resolve(venv: Path) -> dict[str, str]:
    """A venv at `venv` with the newest releases of the requirement names; their pins."""
    _run([sys.executable, "-m", "venv", str(venv)])
    reqs = venv / "requirements-unlocked.txt"
    reqs.write_text("\n".join([TORCH, *(n for n in requirement_names() if n != "torch")]) + "\n")
    cons = venv / "constraints-torch.txt"
    cons.write_text(TORCH + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", "--upgrade", "-r", str(reqs), "-c", str(cons)])
    out = _run([*pip, "freeze", "--all", "--exclude-editable"], capture_output=True).stdout
    pins = read_pins(out)
    pins.pop("pip", None)
    pins.pop("neuronlocal", None)
    return pins


def write_lock(pins: dict[str, str]) -> None:
    lines = [TORCH] + [f"{n}=={v}" for n, v in sorted(pins.items()) if n != "torch"]
    LOCK.write_text(HEADER + "\n".join(lines) + "\n")


def upgrades(locked: dict[str, str], latest: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{name: (locked version or "-", latest version)} for every package that differs."""
    return {n: (locked.get(n, "-"), v) for n, v in sorted(latest.items()) if locked.get(n) != v}


def _link_project(venv: Path) -> None:
    """Make the project importable in `venv` through the project venv's editable install."""
    src = Path(sys.prefix)
    site = lambda p: next((p / "lib").glob("python3*/site-packages"))  # noqa: E731
    files = [*site(src).glob("__editable__*neuronlocal*.pth"),
             *site(src).glob("neuronlocal-*.dist-info")]
    if not files:
        raise SystemExit("tools/lock.py latest: the project venv has no editable neuronlocal; "
                         "run `make setup` first.")
    for f in files:
        dest = site(venv) / f.name
        (shutil.copytree if f.is_dir() else shutil.copy2)(f, dest)


def _pytest(venv: Path, args: list[str], timeout: float) -> tuple[int, list[str]]:
    """Runs pytest in `venv`; (exit status, ids of failed or errored tests)."""
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-rfE", *args]
    print("+ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, []
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    print(tail[0], flush=True)
    failed = [m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", proc.stdout, re.M)]
    return proc.returncode, list(dict.fromkeys(failed))


def latest(budget: float) -> int:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="neuronlocal-latest-") as tmp:
        venv = Path(tmp) / "venv"
        pins = resolve(venv)
        locked = read_pins(LOCK.read_text())
        diff = upgrades(locked, pins)
        print("\nNewer than the lock:" if diff else "\nThe lock is the newest release set.")
        for name, (old, new) in diff.items():
            print(f"  {name:28} {old:>14} -> {new}")
        if not diff:
            return 0
        _link_project(venv)
        left = budget - (time.monotonic() - start)
        status, failed = _pytest(venv, ["-m", "not slow"], timeout=max(60.0, left))
        if status == 124:
            print("test-latest: the suite ran out of time; no verdict.")
            return 0
        if not failed:
            print("test-latest: the default suite passes on the newest releases.")
            return 0
        top = {canonical(n) for n in requirement_names()}
        blame: dict[str, list[str]] = {t: [] for t in failed}
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
               str(venv / "constraints-torch.txt")]
        for name, (old, new) in diff.items():
            if name not in top or old == "-" or time.monotonic() - start > budget:
                continue
            try:
                _run([*pip, f"{name}=={old}"])
                _, still = _pytest(venv, failed, timeout=max(60.0, budget / 4))
            except subprocess.CalledProcessError:
                continue
            finally:
                subprocess.run([*pip, f"{name}=={new}"], text=True, capture_output=True)
            for test in failed:
                if test not in still:
                    blame[test].append(f"{name} {old} -> {new}")
        print(f"\ntest-latest: {len(failed)} test(s) fail on the newest releases:")
        for test, causes in blame.items():
            why = ", ".join(causes) or "no single upgrade (fails with each one put back)"
            print(f"  {test}\n      breaks on: {why}")
    return 0


def update() -> int:
    with tempfile.TemporaryDirectory(prefix="neuronlocal-lock-") as tmp:
        old = read_pins(LOCK.read_text())
        pins = resolve(Path(tmp) / "venv")
    write_lock(pins)
    diff = upgrades(old, pins)
    print(f"constraints.txt: {len(pins)} pins, {len(diff)} changed")
    for name, (was, now) in diff.items():
        print(f"  {name:28} {was:>14} -> {now}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("update", help="rewrite constraints.txt from the newest releases")
    lat = sub.add_parser("latest", help="the default suite on the newest releases (not gating)")
    lat.add_argument("--budget", type=float, default=2400, metavar="SECONDS",
                     help="time for the whole run, reruns included (default 2400)")
    args = parser.parse_args()
    return update() if args.command == "update" else latest(args.budget)


if __name__ == "__main__":
    sys.exit(main())
