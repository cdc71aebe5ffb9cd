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
    why="In the interpreter every scalar a kernel computes (`tl.program_id(0)`, `tl.num_programs(0)`, a "
        "`tl.sum`, a scalar argument) is a NumPy array of shape `(1,)`. Before each launch, "
        "`_patch_lang_tensor` gives `tl.tensor` an `__index__` that converts it with `int(array)`. NumPy "
        "deprecated converting an array with `ndim > 0` to a scalar in 1.25 and refuses it from 2.4 on "
        "(`TypeError: only 0-dimensional arrays can be converted to Python scalars`). Every kernel loop of "
        "the form `for blk in range(pid, n, num_programs)` calls `__index__`, so with Triton 3.3.1 and "
        "NumPy 2.4 all our kernels, and upstream MegaBlocks' too, fail on CPU tensors (247 of 647 tests at "
        "torch 2.7.1). NumPy 2.3.5 with the same Triton runs them (checked). Triton 3.6.0 (the H200's) has "
        "the same definition, set through a scope that undoes it after the launch, and fails the same way "
        "in the interpreter (seen on the H200's CPU, then reproduced here with Triton 3.6.0 and torch "
        "2.13). Triton 3.9 defines `__index__` as `int(data.squeeze())`.",
    how="`megablocks_ascend.compat.interpreter_index_broken()` runs the interpreter's own "
        "`_patch_lang_tensor` on a stand-in class and converts a shape-`(1,)` array with the `__index__` "
        "it defines: only if that raises (and the interpreter is on) is the patch applied. Then "
        "`_patch_lang_tensor` is wrapped: it does what it did, then sets `tl.tensor.__index__` to "
        "`compat.interpreter_index`, Triton 3.9's definition (a 1-element array is squeezed to 0-d first; "
        "a larger one is still refused): directly in Triton 3.3.1's form `(tensor)`, through the launch's "
        "scope in 3.6's form `(tensor, scope)`, so the scope restores it with the rest. Kernel sources are "
        "not changed, so what CUDA and Ascend compile is not changed either (compiled kernels never go "
        "through the interpreter; the Ascend gate's counts are identical with and without it). The patch "
        "refuses to install if the function's parameters are neither `(tensor)` nor `(tensor, scope)`. "
        "After `uninstall()` the next launch sets the original `__index__` again.",
    upstream_fix="None needed from Triton 3.9 on; Triton 3.3.x and 3.6.x (and triton-ascend 3.2.x) "
                 "releases would need the same one-line change in `_patch_lang_tensor`. Pinning NumPy < "
                 "2.4 next to Triton 3.3.1 also avoids it.",
    apply=apply,
    needs_megablocks=False,
)
