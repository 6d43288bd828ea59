"""TEST-ONLY shims: run the pinned stack (DeepSpeed 0.13.2) on a CPU-only torch.

Put this folder on PYTHONPATH (``PYTHONPATH=tests/pinned_shims``) and Python
imports this file at interpreter start, in every process, torchrun workers
included.  Nothing is imported eagerly: each patch is a post-import hook that
runs right after the module it fixes has been loaded, so interpreters that
never import DeepSpeed pay nothing.  See README.md in this folder for why each
shim exists.  Product code must never depend on any of this.

Environment:
  PINNED_SHIMS_DISABLE=1  turn every shim off (this file then does nothing
                          but chain to the next sitecustomize on sys.path).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_STANDINS_DIR = os.path.join(_HERE, "_standins")
_STANDIN_NAMES = ("intel_extension_for_pytorch", "oneccl_bindings_for_pytorch")

# module name -> function(module), run once right after the module executed.
_HOOKS = {}


def _post_import(name):
    def register(func):
        _HOOKS[name] = func
        return func

    return register


class _HookedLoader(importlib.abc.Loader):
    """Wraps a module's real loader and runs the hook after exec_module."""

    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._hook(module)
        except Exception as exc:  # noqa: BLE001 -- a broken shim must not break the import
            warnings.warn(f"tests/pinned_shims: hook for {module.__name__} failed: {exc!r}", stacklevel=1)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path; only claims modules that have a hook."""

    def find_spec(self, fullname, path, target=None):
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, (_PostImportFinder, _StandinFinder)):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader, hook)
        return spec


class _StandinFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: serves the empty IPEX/oneCCL stand-ins from
    _standins/, only when no real package was found and only while DeepSpeed
    runs its CPU accelerator (DS_ACCELERATOR=cpu)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _STANDIN_NAMES or os.environ.get("DS_ACCELERATOR") != "cpu":
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [_STANDINS_DIR])


class _NoOpStream:
    """What CPU_Accelerator.current_stream()/default_stream() return instead of
    None: ZeRO-3's single-rank gather handle calls .synchronize() on it and
    other paths call .wait_stream()/.wait_event().  Every method is a no-op."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _noop

    def __bool__(self):
        return True

    def __repr__(self):
        return "<pinned_shims no-op CPU stream>"


def _noop(*args, **kwargs):
    return None


_NOOP_STREAM = _NoOpStream()


# (a) torch >= 2.4 renamed what DeepSpeed 0.13 imports from torch.distributed.elastic
@_post_import("torch.distributed.elastic.agent.server.api")
def _elastic_api_names(mod):
    if not hasattr(mod, "log") and hasattr(mod, "logger"):
        mod.log = mod.logger
    if not hasattr(mod, "_get_socket_with_port"):
        try:
            from torch.distributed.elastic.utils.distributed import get_socket_with_port
        except ImportError:
            from torch.distributed.elastic.utils.api import get_socket_with_port
        mod._get_socket_with_port = get_socket_with_port


# (b)/(c) defaults DeepSpeed's CPU accelerator needs, set before get_accelerator() runs
@_post_import("deepspeed.accelerator.real_accelerator")
def _accelerator_env_defaults(mod):
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            # Without it DeepSpeed 0.13 auto-detects "cuda" and fails on CPU.
            os.environ["DS_ACCELERATOR"] = "cpu"
    if os.environ.get("DS_ACCELERATOR") == "cpu" and "LOCAL_SIZE" not in os.environ:
        # CPU_Accelerator.device_count() shells out to `numactl --hardware`
        # unless LOCAL_SIZE is set (ZeRO-3 asks for it).
        os.environ["LOCAL_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE") or "1"


# (b)/(c) the CPU accelerator itself: gloo instead of oneCCL, no-op streams
def _is_standin(module):
    origin = getattr(module, "__file__", None) or ""
    return os.path.abspath(origin).startswith(_STANDINS_DIR + os.sep)


@_post_import("deepspeed.accelerator.cpu_accelerator")
def _cpu_accelerator(mod):
    cls = getattr(mod, "CPU_Accelerator", None)
    if cls is None or getattr(cls, "_pinned_shims_patched", False):
        return
    original_init = cls.__init__
    original_current_stream = cls.current_stream
    original_default_stream = cls.default_stream

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        # "ccl" makes DeepSpeed JIT-build its oneCCL op (needs CCL_ROOT); only
        # switch when the oneCCL that was imported is our empty stand-in.
        if getattr(self, "_communication_backend_name", None) == "ccl" and _is_standin(
                sys.modules.get("oneccl_bindings_for_pytorch")):
            self._communication_backend_name = "gloo"

    def current_stream(self, device_index=None):
        stream = original_current_stream(self, device_index)
        return _NOOP_STREAM if stream is None else stream

    def default_stream(self, device_index=None):
        stream = original_default_stream(self, device_index)
        return _NOOP_STREAM if stream is None else stream

    cls.__init__ = __init__
    cls.current_stream = current_stream
    cls.default_stream = default_stream
    cls._pinned_shims_patched = True


# (d) torch >= 2.6 loads with weights_only=True by default; DeepSpeed 0.13's checkpoints
# hold its own classes (LossScaler, ...), which that refuses.
@_post_import("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine")
def _checkpoint_load_full_pickles(mod):
    cls = getattr(mod, "TorchCheckpointEngine", None)
    if cls is None or getattr(cls, "_pinned_shims_patched", False):
        return
    import torch

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    cls.load = load
    cls._pinned_shims_patched = True


class _GatherWaits:
    """deepspeed.comm as DeepSpeed 0.13.2's partition_parameters sees it, except that an
    asynchronous all-gather has finished when the call returns (see README.md: ZeRO-3's blocking
    gather of several parameters waited for the last one only)."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._finished(self._comm.all_gather_into_tensor(*args, **kwargs))

    def all_gather(self, *args, **kwargs):
        return self._finished(self._comm.all_gather(*args, **kwargs))

    @staticmethod
    def _finished(handle):
        if handle is not None:
            handle.wait()
        return handle


# (e) ZeRO-3 on gloo: a blocking gather of several parameters waits for every one, not the last
@_post_import("deepspeed.runtime.zero.partition_parameters")
def _zero3_gathers_wait(mod):
    if os.environ.get("DS_ACCELERATOR") == "cpu" and "gather_waits" not in _skipped():
        mod.dist = _GatherWaits(mod.dist)


def _skipped() -> set:
    """Shims named in PINNED_SHIMS_SKIP (comma-separated): a test shows what one of them prevents."""
    return {name.strip() for name in os.environ.get("PINNED_SHIMS_SKIP", "").split(",") if name.strip()}


def _chain_next_sitecustomize():
    """Python imports only the first sitecustomize on sys.path; run the next
    one (a venv's or the distribution's) so putting this folder first on
    PYTHONPATH does not silently drop it."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 -- a broken chained sitecustomize must not stop python
        warnings.warn(f"tests/pinned_shims: chained sitecustomize {spec.origin} failed: {exc!r}", stacklevel=1)


def _install():
    if os.environ.get("PINNED_SHIMS_DISABLE", "") not in ("", "0"):
        return
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
        sys.meta_path.append(_StandinFinder())
    # A module imported before us (unlikely at interpreter start) gets patched now.
    for name, hook in _HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:
            hook(module)


_install()
_chain_next_sitecustomize()
