"""What every benchmark writes besides its numbers: the log, the environment, the JSON."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch


#: What a benchmark run on a CPU says about its times (the Triton interpreter's, on the host).
CPU_MEASURES_NOTHING = "a CPU run (the Triton interpreter) measures nothing about a device"

#: Where benchmarks write their results unless told (``--out``): ``$OUT`` if set, else this folder
#: of the current directory, which the repository's .gitignore ignores (so a run in a checkout
#: leaves its ``git status`` clean). The recorded results are kept one folder per run,
#: ``benchmarks/results/<date>-<device>-<subject>/`` with its ``RUN.md``, written there on purpose
#: (``--out`` that folder).
DEFAULT_OUT = "bench-results"


def default_out() -> str:
    """The default of every benchmark's ``--out`` (see :data:`DEFAULT_OUT`)."""
    import os  # noqa: PLC0415
    return os.environ.get("OUT") or DEFAULT_OUT


def logger():
    """``(log, lines)``: ``log(s)`` prints ``s`` at once and keeps it in ``lines`` for the log file."""
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)
    return log, lines


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return f"unavailable ({type(e).__name__}: {e})"
    return getattr(mod, "__version__", "?")


def command_line() -> str:
    """The command as run, without the machine's directories: ``python3 -m megablocks_ascend ...``
    for the package's CLI (``sys.argv[0]`` is then the absolute path of its ``__main__``), the
    script's path relative to the working directory otherwise."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "megablocks_ascend":
        argv[0:1] = ["-m", "megablocks_ascend"]
    elif argv and Path(argv[0]).is_absolute():
        try:
            argv[0] = str(Path(argv[0]).relative_to(Path.cwd()))
        except ValueError:
            argv[0] = Path(argv[0]).name
    return " ".join([Path(sys.executable).name] + argv)


def environment(device: torch.device) -> dict:
    """Versions, date, command line and the device's facts."""
    import triton  # noqa: PLC0415
    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=command_line())
    mb = _version("megablocks")
    env["megablocks"] = "0.10.0" if mb == "?" else mb
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda,
                   memory_gib=round(p.total_memory / 2**30, 1),
                   l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:  # noqa: BLE001
            env["driver"] = "?"
    elif device.type == "npu":
        env["torch_npu"] = _version("torch_npu")
        npu = getattr(torch, "npu", None)
        try:
            env["device"] = npu.get_device_name(device.index or 0)
        except Exception as e:  # noqa: BLE001
            env["device"] = f"npu ({type(e).__name__}: {e})"
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()}), Triton interpreter")
    return env


def write_json(path: Path, report: dict) -> None:
    Path(path).write_text(json.dumps(report, indent=1, default=str))


def fmt(value, spec: str, width: int = 0) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None, right-aligned to ``width``."""
    text = "-" if value is None else format(value, spec)
    return text.rjust(width)
