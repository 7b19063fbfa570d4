"""Fakes shared by the supervisor's tests: a manual clock, a scripted OS layer, a supervisor
driven by a script, a fake NVML and fake cgroup trees. Each stands in for one real part
(named in its module), whose own integration tests run against the real thing."""
