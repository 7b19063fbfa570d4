"""The `onecard` command: run, check, status.

Heavy imports (pydantic, asyncio machinery) happen inside the commands that need
them, so that `onecard status` stays fast enough to be an exec probe.
"""

from __future__ import annotations

import os
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run several GPU inference services on one card as one unit.")

CONFIG_HELP = "TOML config file (default: $ONECARD_CONFIG, else configs/default.toml)"
SET_HELP = "Override a key, e.g. --set services.detect.port=9000 (repeatable; wins over ONECARD_* variables)"


def _config_path(config: Optional[str]) -> str:
    return config or os.environ.get("ONECARD_CONFIG") or "configs/default.toml"


def _load(config: Optional[str], sets: List[str]):
    from supervisor.config import ConfigError, load_config
    from supervisor.cpuquota import read_cpu_quota
    from supervisor.gpu import GpuFacts
    from supervisor.mps import MpsDaemon
    from supervisor.plan import build_plan
    path = _config_path(config)
    try:
        gpu = GpuFacts(os.environ.get("CUDA_VISIBLE_DEVICES", "0") or "0")
        cfg = load_config(path, sets, gpu_total_bytes=gpu.total_bytes())
        plan = build_plan(cfg, read_cpu_quota(), os.environ)
        if plan.mps_dir is not None:
            problem = MpsDaemon(plan.mps_dir).problem()
            if problem:
                raise ConfigError(f"{path}: gpu.mps: {problem}")
    except ConfigError as exc:
        typer.echo(f"onecard: configuration error\n{exc}", err=True)
        raise typer.Exit(ConfigError.exit_code)
    return path, cfg, plan


@app.command()
def run(
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    log_format: Optional[str] = typer.Option(None, "--log-format", help="text or json"),
) -> None:
    """Start every service, watch them, and exit when any of them dies or hangs."""
    import asyncio
    from supervisor.unit import Supervisor
    sets = list(set_) + ([f'supervisor.log_format="{log_format}"'] if log_format else [])
    _path, cfg, plan = _load(config, sets)
    code = asyncio.run(Supervisor(cfg, plan).run())
    raise typer.Exit(code)


@app.command()
def check(
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Validate the configuration and print what `run` would start, without starting it."""
    import shlex
    path, cfg, plan = _load(config, list(set_))
    s = cfg.supervisor
    q = plan.quota
    out = [f"config  {path}: valid",
           f"supervisor  grace {s.grace_s:g} s, start-up timeout {s.startup_timeout_s:g} s, "
           f"liveness every {s.liveness_period_s:g} s ({s.liveness_failures} misses = dead)",
           f"probes  http://{s.health_host}:{s.health_port}/healthz /readyz /metrics"
           if s.health_port else "probes  disabled (health_port = 0)",
           f"control  {s.control_socket}",
           f"gpu  CUDA_VISIBLE_DEVICES={cfg.gpu.visible_devices}, MPS "
           + (f"on (pipe and log under {plan.mps_dir})" if plan.mps_dir else "off"),
           "gpu  " + _gpu_line(cfg.gpu.visible_devices),
           f"cpu  {q.cpus:g} usable CPUs ({q.source}; affinity {q.affinity}, "
           f"quota {'none' if q.quota is None else f'{q.quota:g}'})"]
    for sp in plan.services:
        svc = cfg.services[sp.name]
        budget = (f"{svc.gpu_memory_fraction:g} of the card" if svc.gpu_memory_fraction is not None else
                  f"{svc.gpu_memory_bytes} bytes" if svc.gpu_memory_bytes is not None else "none")
        out.append("")
        out.append(f"service {sp.name}  http://{sp.host}:{sp.port}  threads {sp.threads}  "
                   f"GPU memory budget {budget}")
        out.append(f"  command  {shlex.join(sp.argv)}")
        for k in sorted(sp.env_own):
            out.append(f"  env  {k}={sp.env_own[k]}")
    for w in plan.warnings:
        out.append(f"warning: {w}")
    typer.echo("\n".join(out))


def _gpu_line(device: str) -> str:
    from supervisor.gpu import GpuFacts
    facts = GpuFacts(device).read()
    if not facts["available"]:
        return f"none ({facts['reason']})"
    return (f"{facts['name']}, {facts['memory_used_bytes'] / 2**30:.1f} / "
            f"{facts['memory_total_bytes'] / 2**30:.1f} GiB used")


@app.command()
def status(
    socket: Optional[str] = typer.Option(None, "--socket", help="control socket (default: $ONECARD_CONTROL_SOCKET or the config's)"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="read the socket path from this config"),
    as_json: bool = typer.Option(False, "--json", help="the full status document (stable keys)"),
    watch: bool = typer.Option(False, "--watch", "-w", help="refresh until Ctrl-C"),
    interval: float = typer.Option(1.0, "--interval", help="seconds between refreshes with --watch"),
) -> None:
    """Show what runs and how it is doing. Exit 0 all ready, 1 not, 2 no supervisor."""
    from supervisor import status as st
    raise typer.Exit(st.main(socket, config, as_json, watch, interval))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
