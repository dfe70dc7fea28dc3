"""The CPU kernels: ``cpu_kernels.h`` (the interface, declared once), ``cpu_kernels.c``, ``build``
(compile, load, check) and ``bindings`` (arguments by name), and the calls that use them."""
