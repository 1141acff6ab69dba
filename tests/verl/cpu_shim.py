"""verl's real FSDP2 engine on CPU in a test process: the product's CPU platform and gloo process group
(``experiments.backends.verl.cpu.install``, ``init_gloo``), imported by plain name in spawned test processes."""

from experiments.backends.verl.cpu import init_gloo, install  # noqa: F401  (the tests' entry point)
