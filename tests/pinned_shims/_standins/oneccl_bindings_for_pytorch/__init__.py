"""Empty stand-in for ``oneccl_bindings_for_pytorch`` (TEST-ONLY, CPU CI).

``deepspeed/accelerator/cpu_accelerator.py`` (0.13.2) imports it at module
level only to register the "ccl" torch.distributed backend.  The shims switch
DeepSpeed's CPU communication backend to "gloo", so nothing from oneCCL is
ever called; this module exists only so that import succeeds.
"""
