"""Put on PYTHONPATH only while tools/bootstrap.sh builds MegaBlocks: its setup.py compiles the CUDA
extension ``megablocks_ops`` whenever torch is a CUDA build and ``torch.utils.cpp_extension`` finds
a CUDA toolkit (``nvcc`` on PATH, ``CUDA_HOME`` or ``/usr/local/cuda``), and then asks the GPU for
its compute capability, which fails on a machine with a toolkit but no GPU. megablocks-ascend
supplies ``megablocks_ops`` itself (patches/megablocks-ops-extension.md), so MegaBlocks is built
without it: once ``torch.utils.cpp_extension`` has executed, its ``CUDA_HOME`` reads None, as on a
machine without a toolkit. Imports nothing until a process imports that module."""

import importlib.util
import sys

TARGET = "torch.utils.cpp_extension"


class _NoCudaHome:
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_without_cuda_home(module):
            exec_module(module)
            module.CUDA_HOME = None

        spec.loader.exec_module = exec_without_cuda_home
        return spec


sys.meta_path.insert(0, _NoCudaHome())
