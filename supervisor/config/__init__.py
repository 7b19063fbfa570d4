"""The configuration: what the operator writes, read and checked once by the command line.

- `settings`: the supervisor's and the GPU's keys (plain dataclasses, declared once; the
  long-running supervisor process gets them typed without pydantic);
- `schema`: the services and the whole file (pydantic);
- `loading`: TOML, ``ONECARD_*`` variables and ``--set`` merged, one error for every problem;
- `validation`: rules across keys; `derived`: what follows from a valid config;
- `location`: which file a command reads; `redact`: what is secret; `errors`: ConfigError.

May import: the standard library, pydantic (schema, loading, validation only), annotated_types
(settings). Nothing else of the supervisor: every other part may import this one.
"""
