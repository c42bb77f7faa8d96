"""Every Python binding of pagedkv's native sources (``pagedkv/csrc``), one module per library.

This layer sits below ``attention`` and ``model`` (it imports neither) and above ``csrc`` (the
sources, data only), ``cpu_isa`` and ``utils``; ``tests/test_architecture.py`` checks that no
module outside it builds or loads a C library.

* :mod:`pagedkv.ops.build`: the one compiler driver and cache (``compile_c``, ``BuiltOnce``)
* :mod:`pagedkv.ops.cpu_kernel`: paged attention and K/V writes (``cpu_kernel.c``)
* :mod:`pagedkv.ops.step_op`: a compiled step's attention op in C++ (``step_op.cpp``)
* :mod:`pagedkv.ops.fused_ops`: RMSNorm, RoPE and activation passes (``fused_ops.c``)
* :mod:`pagedkv.ops.qmm`: integer matmuls of int4/int8 and GGUF weights (``qmm.c``)
* :mod:`pagedkv.ops.decoder`: the native step loop over the decoder layers (``decoder.c``)
* :mod:`pagedkv.ops.sample_ops`: greedy and inverse-CDF picks (``sample_ops.c``)
* :mod:`pagedkv.ops.int8_mm`: the torch ops ``pagedkv::int8_linear`` (oneDNN's prepacked
  u8s8 linear) and ``pagedkv::qmm_linear`` (``qmm.c``) that compiled steps call
* :mod:`pagedkv.ops.native`: builds them all at start and says which are in use
  (``python -m pagedkv.ops.native``)
"""
