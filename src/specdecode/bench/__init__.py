"""Benchmarks: real prompt suites, our methods beside Hugging Face's, the paper's cost model."""
