"""Fakes shared by the tests, each standing in for one real part (named in its module),
whose own integration tests run against the real thing: for the supervisor, a manual clock,
a scripted OS layer, a supervisor driven by a script, a fake NVML and fake cgroup trees; for
the services' runtime, a model backend that records its calls and the scheduler around it."""
