"""The test bed: what tests, demos and benchmarks use to exercise poolpipe on one machine,
apart from what serves: a stage client without Triton (fake_stages.py)."""
