"""Tools for tests and benchmarks (process trees, network-namespace hosts); the library never imports them."""
