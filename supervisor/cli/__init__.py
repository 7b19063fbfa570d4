"""The command line: `onecard run | check | status | stop`.

- `early`: what `onecard` does in its first milliseconds (signals held, standard streams);
- `commands`: the typer commands; `quick`: `status` and `stop` without typer;
- `status`: the control socket's client (`onecard status`, `onecard stop`);
- `handover`: `run` execs a lean process once the config is valid;
- `supervise`: that lean process: the driver with typed settings, without pydantic.

May import every other part of the supervisor. Only `commands` imports typer, and only the
config's `schema`, `loading` and `validation` (which `commands` uses) import pydantic.
"""
