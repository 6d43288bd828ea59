"""Empty stand-in for ``intel_extension_for_pytorch`` (TEST-ONLY, CPU CI).

DeepSpeed 0.13.2 refuses to build its CPU accelerator unless this module
imports (``DS_ACCELERATOR=cpu``), and its accelerator auto-detection calls
``ipex._C._has_xpu()``.  Nothing else is used: the CPU accelerator runs on
plain torch.  ``../../sitecustomize.py`` serves this module only when no real
IPEX is installed and only while ``DS_ACCELERATOR=cpu``.

No ``__version__`` and no dist-info on purpose: transformers and accelerate
look IPEX up through ``importlib.metadata`` and must keep seeing it as absent.
"""


class _C:
    @staticmethod
    def _has_xpu() -> bool:
        return False
