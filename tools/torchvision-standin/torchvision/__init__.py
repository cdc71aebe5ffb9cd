"""A stand-in for torchvision (CI only; see tools/torchvision-standin/pyproject.toml).

Composer and Streaming import torchvision and a few of its names at import time. Every name this
package is asked for is a placeholder class: importing and subclassing it work (Composer and
Streaming subclass ``VisionDataset``), creating or calling it raises :class:`StandInError`.
"""

__version__ = "0.0.0+megablocks-ascend-standin"


class StandInError(RuntimeError):
    pass


def placeholder(module: str, name: str) -> type:
    def refuse(*args, **kwargs):
        raise StandInError(f"{module}.{name}: this torchvision is megablocks-ascend's CI stand-in, which has "
                           "no vision features; install the torchvision that matches your torch")
    return type(name, (), {"__init__": refuse, "__module__": module, "__doc__": "stand-in: raises when created"})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
