"""The test bed: what tests, demos and benchmarks use to exercise poolpipe on one machine,
apart from what serves. A multi-host cluster of network namespaces (netns.py), load
generators (loadgen.py), CPU accounting (cpu.py), the simulator's prediction for a live
deployment (predict.py), a stage client without Triton (fake_stages.py), and another
process holding the warehouse (holder.py).

Production adapters (triton_backend, flows) import none of it, nor the simulator: an import
contract checks it (pyproject.toml, tests/test_import_contracts.py)."""
