"""The ``triton-interpreter-index`` patch (page: ``patches/triton-interpreter-index.md``): where the
Triton interpreter (3.3.1, 3.6.0) cannot use a scalar as an index with NumPy >= 2.4, its tensors get
Triton 3.9's ``__index__`` (:func:`megablocks_ascend.compat.interpreter_index`).
"""

from __future__ import annotations

import inspect

from megablocks_ascend.patching.registry import Patch, PatchError, owner


def apply(p: Patch) -> None:
    from megablocks_ascend import compat  # noqa: PLC0415
    if not compat.interpreter_active() or not compat.interpreter_index_broken():
        return  # compiled Triton, or an interpreter that converts scalars correctly
    target = "triton.runtime.interpreter._patch_lang_tensor"
    module, attr = owner(target)
    original = getattr(module, attr)
    params = tuple(inspect.signature(original).parameters)
    if params not in compat.INTERPRETER_TENSOR_FORMS:
        raise PatchError(f"{target} has parameters {params}, but megablocks-ascend was written against "
                         f"{' or '.join(map(str, compat.INTERPRETER_TENSOR_FORMS))}; this Triton version "
                         "is not supported by this megablocks-ascend version")

    def _patch_lang_tensor(tensor, *scope):
        original(tensor, *scope)
        if scope:  # Triton 3.6: through the launch's scope, which restores it after the launch
            scope[0].set_attr(tensor, "__index__", compat.interpreter_index)
        else:  # Triton 3.3.1: set directly, as the original does
            tensor.__index__ = compat.interpreter_index

    _patch_lang_tensor.__wrapped__ = original
    _patch_lang_tensor.__signature__ = inspect.signature(original)
    p.replace(target, _patch_lang_tensor)


PATCH = Patch(
    name="triton-interpreter-index",
    targets=("triton.runtime.interpreter._patch_lang_tensor",),
    why="The interpreters of Triton 3.3.1 and 3.6.0 convert a scalar (a NumPy array of shape "
        "(1,)) to an int with int(array), which NumPy 2.4 refuses, so every kernel with a loop such as "
        "range(pid, n, num_programs) fails on CPU tensors: 'only 0-dimensional arrays can be "
        "converted to Python scalars'.",
    how="Only with the interpreter on, and only when its own definition fails that conversion: "
        "the function that sets the interpreter's tl.tensor methods before each launch is "
        "wrapped to set __index__ to int(data.squeeze()), Triton 3.9's definition. Compiled "
        "kernels (CUDA, NPU) are not involved.",
    upstream_fix="None needed in Triton 3.9 (it squeezes); 3.3.x and 3.6.x releases would need the "
                 "same one-line fix.",
    apply=apply,
    needs_megablocks=False,
)
