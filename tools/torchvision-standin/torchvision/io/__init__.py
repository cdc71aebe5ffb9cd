"""torchvision.io stand-in (see torchvision/__init__.py)."""

from torchvision import placeholder


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
