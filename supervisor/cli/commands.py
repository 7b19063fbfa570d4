"""The `onecard` command: run, check, status, stop, `jobs redrive` and `new-service`.

Every command finds its config the same way (config/location.py): ``--config``, else
``$ONECARD_CONFIG``, else the default that ships in the package; nothing depends on the
current directory. Heavy imports (pydantic, asyncio machinery) happen inside the commands
that need them, so that `onecard status` stays fast enough to be an exec probe (and skips
typer altogether: quick.py); `run` hands over to a lean process once the config is valid
(handover.py).
"""

from __future__ import annotations

import os
from typing import List, Optional  # typer reads these annotations at run time (per-file-ignores)

import typer

from supervisor.version import version

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run several GPU inference services on one card as one unit.")

CONFIG_HELP = ("TOML config file (default: $ONECARD_CONFIG, else the built-in default, a copy of "
               "configs/default.toml)")
SET_HELP = "Override a key, e.g. --set services.detect.port=9000 (repeatable; wins over ONECARD_* variables)"
SOCKET_HELP = "control socket (default: $ONECARD_CONTROL_SOCKET, else the config's supervisor.control_socket)"


def _version(value: bool) -> None:
    if value:
        import platform
        typer.echo(f"onecard {version()} (Python {platform.python_version()})")
        raise typer.Exit(0)


@app.callback()
def main_options(
    _version_flag: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit."),
) -> None:
    """Run several GPU inference services on one card as one unit."""


def _load(config: Optional[str], sets: List[str]):
    from common.hostmemory import memory_limit
    from supervisor.config.errors import ConfigError
    from supervisor.config.loading import load_config
    from supervisor.config.location import resolve
    from supervisor.policy.plan import build_plan
    from supervisor.system.cpu_cgroup import read_cpu_quota
    from supervisor.system.mps_control import MpsControl
    from supervisor.system.nvml import GpuFacts
    source = resolve(config)
    try:
        # byte budgets are judged against the card the services get (gpu.visible_devices)
        cfg = load_config(source.path, sets, gpu_total_bytes=lambda devices: GpuFacts(devices).total_bytes(),
                          origin=source.origin if source.origin != "built-in default" else None)
        plan = build_plan(cfg, read_cpu_quota(), os.environ, memory_limit())
        if plan.mps_dir is not None:
            problem = MpsControl(plan.mps_dir).problem()
            if problem:
                raise ConfigError(f"{source.path}: gpu.mps: {problem}")
    except ConfigError as exc:
        try:
            typer.echo(f"onecard: configuration error\n{exc}", err=True)
        except OSError:  # stderr unusable: the exit code still says what happened
            pass
        raise typer.Exit(ConfigError.exit_code) from None
    return source.path, cfg, plan


@app.command()
def run(
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    log_format: Optional[str] = typer.Option(None, "--log-format", help="text or json"),
) -> None:
    """Start every service, watch them, and exit when any of them dies or hangs."""
    sets = list(set_) + ([f'supervisor.log_format="{log_format}"'] if log_format else [])
    _path, cfg, plan = _load(config, sets)
    from supervisor.cli.handover import exec_supervisor
    exec_supervisor(cfg, plan)  # returns only where exec is not possible
    from supervisor.cli.supervise import supervise
    raise typer.Exit(supervise(cfg.supervisor, cfg.gpu, plan))


@app.command()
def check(
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Validate the configuration and print what `run` would start, without starting it.
    Secrets (keys, tokens, passwords, URL passwords) are shown as <redacted>."""
    import shlex

    from supervisor.config.derived import termination_grace_min
    from supervisor.config.redact import redact_argv, redact_env
    path, cfg, plan = _load(config, list(set_))
    settings = cfg.supervisor
    quota = plan.quota
    drains = sorted({sp.drain_s for sp in plan.services})
    out = [f"config  {path}: valid",
           f"supervisor  grace {settings.grace_s:g} s, start-up timeout {settings.startup_timeout_s:g} s, "
           f"liveness every {settings.liveness_period_s:g} s ({settings.liveness_failures} misses = dead)",
           f"stop  service drain {'/'.join(f'{d:g}' for d in drains)} s < supervisor grace {settings.grace_s:g} s "
           f"< orchestrator: terminationGracePeriodSeconds (docker stop --time) at least "
           f"{termination_grace_min(cfg):g} s",
           f"probes  http://{settings.health_host or '*'}:{settings.health_port}/healthz /readyz /metrics"
           + (" (every interface, IPv4 and IPv6)" if not settings.health_host else "")
           if settings.health_port else "probes  disabled (health_port = 0)",
           f"control  {settings.control_socket} (run directory {plan.run_dir})",
           f"gpu  CUDA_VISIBLE_DEVICES={cfg.gpu.visible_devices}, MPS "
           + (f"on (pipe and log under {plan.mps_dir})" if plan.mps_dir else "off"),
           "gpu  " + _gpu_line(cfg.gpu.visible_devices),
           f"cpu  {quota.cpus:g} usable CPUs ({quota.source}; affinity {quota.affinity}, "
           f"quota {'none' if quota.quota is None else f'{quota.quota:g}'})"]
    for sp in plan.services:
        svc = cfg.services[sp.name]
        budget = (f"{svc.gpu_memory_fraction:g} of the card" if svc.gpu_memory_fraction is not None else
                  f"{svc.gpu_memory_bytes} bytes" if svc.gpu_memory_bytes is not None else "none")
        out.append("")
        out.append(f"service {sp.name}  http://{sp.host}:{sp.port}  threads {sp.threads}  "
                   f"GPU memory budget {budget}")
        out.append(f"  command  {shlex.join(redact_argv(sp.argv))}")
        env = redact_env(sp.env_own)
        for k in sorted(env):
            out.append(f"  env  {k}={env[k]}")
        out.append("  env  ONECARD_INSTANCE_TOKEN=(new at each start)")
    for w in plan.warnings:
        out.append(f"warning: {w}")
    typer.echo("\n".join(out))


def _gpu_line(device: str) -> str:
    from supervisor.system.nvml import GpuFacts
    facts = GpuFacts(device).read()
    if not facts["available"]:
        return f"none ({facts['reason']})"
    return (f"{facts['name']}, {facts['memory_used_bytes'] / 2**30:.1f} / "
            f"{facts['memory_total_bytes'] / 2**30:.1f} GiB used")


@app.command()
def status(
    socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="the full status document (stable keys)"),
    watch: bool = typer.Option(False, "--watch", "-w", help="refresh until Ctrl-C (or --count)"),
    interval: float = typer.Option(1.0, "--interval", help="seconds between refreshes with --watch"),
    count: int = typer.Option(0, "--count", help="with --watch: stop after this many refreshes (0: never)"),
) -> None:
    """Show what runs and how it is doing. Exit 0 all ready, 1 not, 2 no supervisor."""
    from supervisor.cli import status as st
    raise typer.Exit(st.main(socket, config, as_json, watch, interval, count))


@app.command()
def stop(
    socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until the supervisor is gone"),
    timeout: float = typer.Option(120.0, "--timeout", help="with --wait: give up after this many seconds"),
) -> None:
    """Stop the unit gracefully (as SIGTERM does). Exit 0 stopped (or asked with --no-wait),
    1 still running after --timeout, 2 no supervisor."""
    from supervisor.cli import status as st
    raise typer.Exit(st.stop(socket, config, wait, timeout))


@app.command("new-service")
def new_service(
    name: str = typer.Argument(..., help="the service's name: lower-case letters, digits and '_'"),
    directory: Optional[str] = typer.Option(None, "--dir", help="where to write it (default ./NAME; new or empty)"),
    route: Optional[str] = typer.Option(None, "--route", help="its route (default /api/v1/NAME)"),
) -> None:
    """Write a working service skeleton: its module and settings, a test that starts it and
    sends a picture, and the block for the unit's config (docs/services/writing-a-service.md)."""
    from onecard.scaffold import write_service  # standard library only: the CLI stays fast

    try:
        files = write_service(name, directory, route)
    except (ValueError, FileExistsError) as exc:
        typer.echo(f"onecard new-service: {exc}", err=True)
        raise typer.Exit(2) from None
    for path in files:
        typer.echo(str(path))


jobs_app = typer.Typer(no_args_is_help=True, help="The jobs queue, through a unit's jobs API.")
app.add_typer(jobs_app, name="jobs")
JOBS_URL_HELP = "the jobs API (default: $ONECARD_JOBS_URL, else http://127.0.0.1:7863)"


@jobs_app.command("redrive")
def jobs_redrive(
    job_id: Optional[str] = typer.Option(None, "--id", help="one dead-lettered job"),
    model: Optional[str] = typer.Option(None, "--model", help="a model label: its dead-lettered jobs, oldest first"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="with --model: at most this many"),
    url: Optional[str] = typer.Option(None, "--url", help=JOBS_URL_HELP),
    api_key_env: str = typer.Option("ONECARD_JOBS_API_KEY", "--api-key-env",
                                    help="environment variable holding the jobs API key, if it has one"),
) -> None:
    """Put dead-lettered jobs back on their queue, attempts reset. Prints the API's answer
    (JSON). Exit 0 done, 1 refused (the message says why), 2 no jobs API answers."""
    import json
    import urllib.error
    import urllib.request

    if (job_id is None) == (model is None):
        typer.echo("onecard jobs redrive: give --id or --model (one of them)", err=True)
        raise typer.Exit(2)
    base = (url or os.environ.get("ONECARD_JOBS_URL") or "http://127.0.0.1:7863").rstrip("/")
    if job_id is not None:
        path, body = f"/v1/jobs/{job_id}/redrive", b""
    else:
        path = "/v1/jobs/redrive"
        body = json.dumps({"model": model, **({"limit": limit} if limit else {})}).encode()
    headers = {"content-type": "application/json"}
    if os.environ.get(api_key_env):
        headers["x-api-key"] = os.environ[api_key_env]
    req = urllib.request.Request(base + path, data=body, headers=headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a unit's own port: never a proxy
    try:
        with opener.open(req, timeout=60) as resp:
            typer.echo(resp.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        typer.echo(exc.read().decode(errors="replace") or f"HTTP {exc.code}", err=True)
        raise typer.Exit(1) from None
    except (urllib.error.URLError, OSError) as exc:
        typer.echo(f"onecard jobs redrive: no jobs API answers at {base}: {exc}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
