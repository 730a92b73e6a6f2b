"""`voice-agent`: the command line of the service."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    from app.server import run_server
    from app.settings import get_settings

    settings = get_settings()
    if args.host:
        settings.host = args.host
    if args.port is not None:
        settings.port = args.port
    if args.simulator:
        settings.realtime_simulator = True
    return _traced("voice-agent", lambda: run_server(settings, with_worker=not args.no_worker))


def _traced(service: str, run: Any) -> int:
    """Run a long-lived command with this process's traces exported (if OTEL_* asks)."""
    from app.tracing import configure_tracing

    provider = configure_tracing(service)
    try:
        return int(run())
    finally:
        if provider is not None:
            provider.shutdown()  # the last spans go out before the process does


def _worker(args: argparse.Namespace) -> int:
    from app.db import require_migrated, resolve_database_url
    from app.event_loops import loop_factory
    from app.ops.worker import run_worker
    from app.settings import get_settings
    from app.tool_wiring import load_configured_catalog

    settings = get_settings()
    # A catalog that cannot run is refused first: that check needs no database.
    asyncio.run(load_configured_catalog(settings).aclose())
    # Workers never migrate (serve and `db upgrade` do): an old schema is a clear stop.
    require_migrated(resolve_database_url(settings.database_url, settings.data_dir))
    # The same event loop as `serve` (EVENT_LOOP): uvloop where installed.
    factory = loop_factory(settings.event_loop)

    def run() -> int:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(run_worker(settings, concurrency=args.concurrency))

    return _traced("voice-agent-worker", run)


def _database_url() -> str:
    from app.db import resolve_database_url
    from app.settings import get_settings

    settings = get_settings()
    return resolve_database_url(settings.database_url, settings.data_dir)


def _at(revision: str | None) -> str:
    from app.db import head_revision

    if revision is None:
        return "base (no tables)"
    return f"{revision} (head)" if revision == head_revision() else revision


def _db_upgrade(args: argparse.Namespace) -> int:
    from app.db import upgrade_to

    before, after = upgrade_to(_database_url(), args.revision)
    if before == after:
        print(f"database is at {_at(after)}: nothing to do")
    else:
        print(f"database is at {_at(after)} (was {_at(before)})")
    return 0


def _db_downgrade(args: argparse.Namespace) -> int:
    from app.db import database_revision, downgrade_to
    from app.errors import StartupError

    url = _database_url()
    if not args.yes:
        raise StartupError(
            f"the database is at {_at(database_revision(url))}; downgrading to "
            f"{args.revision} drops the newer tables and their rows: add --yes to do it"
        )
    before, after = downgrade_to(url, args.revision)
    print(f"database is at {_at(after)} (was {_at(before)})")
    return 0


def _db_current(args: argparse.Namespace) -> int:
    from app.db import database_revision, head_revision

    current = database_revision(_database_url())
    print(f"database is at {_at(current)}; this version's head is {head_revision()}")
    return 0


def _simulator(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from telephony.sim.simulator import run_simulator
    from telephony.sim.speech import speech_setup

    settings = get_settings()
    speech = speech_setup(
        settings.sim_voice,
        piper_model=settings.sim_piper_voice,
        cache_dir=settings.speech_cache_path(),
        recognition=settings.sim_recognition,
        vad=settings.sim_vad,
    )
    return run_simulator(host=args.host, port=args.port, scenario=args.scenario, speech=speech)


def _call(args: argparse.Namespace) -> int:
    from telephony.sim.fake_caller import main as caller_main

    return caller_main(args)


def _demo(args: argparse.Namespace) -> int:
    from app.cli.demo import run_demo

    return run_demo(args)


def _eval(args: argparse.Namespace) -> int:
    from app.cli.evals import run_eval_command
    from app.settings import get_settings

    return run_eval_command(args.files, args.junit, get_settings())


def _replay(args: argparse.Namespace) -> int:
    from app.cli.replay import run_replay_command
    from app.settings import get_settings

    return run_replay_command(args.call_id, args.save, args.database_url, get_settings())


def _dial(args: argparse.Namespace) -> int:
    from app.cli.dial import run_dial_command
    from app.settings import get_settings

    return run_dial_command(
        args.number, args.purpose, args.operation, args.server, args.token, get_settings()
    )


def _cluster(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.cli.cluster import ClusterConfig, run_cluster

    return run_cluster(
        ClusterConfig(
            directory=Path(args.dir),
            host=args.host,
            http_port=args.http_port,
            sip_port=args.sip_port,
            replicas=args.replicas,
            workers=args.workers,
            rtp_base=args.rtp_base,
            database_url=args.database_url,
            simulator=args.simulator,
            ds_ping_interval_s=args.ds_ping_interval,
        )
    )


def _sor(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from tools.restaurant.sor import run_sor

    settings = get_settings()
    url = args.database_url or settings.sor_database_url
    if url is None:
        from app.db import resolve_database_url

        url = resolve_database_url(settings.database_url, settings.data_dir)
    return run_sor(host=args.host, port=args.port, database_url=url)


def _tools_schema(args: argparse.Namespace) -> int:
    import json

    from tools.tools_file_model import tools_file_schema

    print(json.dumps(tools_file_schema(), indent=2))
    return 0


def _tools_check(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from app.tool_wiring import (
        configured_transfers,
        load_configured_agents,
        load_configured_catalog,
        plugin_of,
    )
    from tools.registry import ToolKind

    settings = get_settings()
    catalog = load_configured_catalog(settings)  # CatalogError: reported by main()
    try:
        agents = load_configured_agents(settings, catalog)  # StartupError: reported by main()
        transfers = configured_transfers(settings, catalog)
    except BaseException:
        asyncio.run(catalog.aclose())
        raise
    sources = [s for s in (plugin_of(settings), settings.tools_file) if s]
    print(f"catalog {catalog.name} ({', '.join(map(str, sources))}): ok")
    for spec in catalog.registry:
        flags = [spec.kind.value]
        if spec.needs_confirmation:
            flags.append("confirmation")
        elif spec.kind is ToolKind.MUTATION:
            flags.append("no confirmation")
        if spec.needs_verification:
            flags.append("verification")
        if spec.kind is ToolKind.MUTATION:
            flags.append("idempotent" if spec.provider_idempotent else "not idempotent")
            flags.append(f"unknown: {spec.reconcile or spec.on_unknown.value}")
        print(f"  {spec.name}: {', '.join(flags)}")
    if agents is None:
        print("agents: one, with every tool (no AGENTS_FILE, no `agents` in the tools file)")
    else:
        print(f"agents ({agents.source}), starting with {agents.start}:")
        for agent in agents.agents.values():
            parts = [f"tools: {', '.join(sorted(agent.tools)) or 'control tools only'}"]
            parts.append(f"hands off to: {', '.join(agent.handoffs) or 'nobody'}")
            if agent.disclose is not None:
                parts.append(f"discloses: {', '.join(sorted(agent.disclose)) or 'nothing'}")
            if agent.voice is not None:
                parts.append(f"voice: {agent.voice}")
            print(f"  {agent.name}: {'; '.join(parts)}")
    if transfers:
        print(f"transfer targets ({'tools file' if catalog.transfers else 'TRANSFER_TARGETS'}):")
        for target in transfers.values():
            limits = [f"open {target.hours.text} ({target.hours.zone})"] if target.hours else []
            limits += ["verified callers only"] if target.verified_only else []
            print(f"  {target.name}: {target.masked()}" + (f"; {', '.join(limits)}" * bool(limits)))
    for notice in catalog.notices():
        print(f"note: {notice}")
    asyncio.run(catalog.aclose())
    return 0


def package_version() -> str:
    """The installed package's version (`voice-agent --version`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("voice-agent")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class _HelpFormatter(argparse.HelpFormatter):
    """Help that names each option's default unless its text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = action.default
        if (
            text
            and "default" not in text
            and default not in (None, False, argparse.SUPPRESS)
            and (action.option_strings or action.nargs in ("?", "*"))
        ):
            text += " (default: %(default)s)"
        return text


class _Subcommands(argparse._SubParsersAction):
    """Subcommands whose own --help opens with the line the command list shows."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("description", kwargs.get("help"))
        return super().add_parser(name, **kwargs)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser, so every --help shows defaults the same way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)


def _port(text: str) -> int:
    """A TCP port for --port (0: any free one)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return int(text)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="voice-agent", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        help="log level of this command (default: LOG_LEVEL, else INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("serve", help="HTTP + WebSocket server (with an in-process worker)")
    p.add_argument(
        "--host", default=None, help="address to listen on (default: HOST, else 127.0.0.1)"
    )
    p.add_argument(
        "--port",
        type=_port,
        default=None,
        help="port to listen on, 0 for any free one (default: PORT, else 8000)",
    )
    p.add_argument(
        "--no-worker",
        action="store_true",
        help="run no operation worker in this process (run `voice-agent worker` instead;"
        " SIP outbound calls need one beside SIP_BIND)",
    )
    p.add_argument(
        "--simulator",
        action="store_true",
        help="calls talk to the local Realtime simulator, even in production or with "
        "OPENAI_API_KEY (as REALTIME_SIMULATOR=true)",
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser("worker", help="run operation workers only")
    p.add_argument(
        "--concurrency",
        type=_positive,
        default=None,
        help="jobs run at once (default: WORKER_CONCURRENCY, else 4)",
    )
    p.set_defaults(func=_worker)

    p = sub.add_parser("db", help="database commands")
    dbsub = p.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", help="apply migrations (never goes back)")
    up.add_argument("revision", nargs="?", default="head", help="the revision to go forward to")
    up.set_defaults(func=_db_upgrade)
    down = dbsub.add_parser("downgrade", help="undo migrations (drops their tables)")
    down.add_argument("revision", help="the revision to go back to (`base`: nothing)")
    down.add_argument("--yes", action="store_true", help="yes, drop the newer tables")
    down.set_defaults(func=_db_downgrade)
    cur = dbsub.add_parser("current", help="the revision the database is at")
    cur.set_defaults(func=_db_current)

    p = sub.add_parser("simulator", help="local stand-in for the OpenAI Realtime API")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8765, help="port to listen on")
    p.add_argument("--scenario", default=None, help="scenario JSON file (default: built-in)")
    p.set_defaults(func=_simulator)

    p = sub.add_parser("call", help="a simulated Twilio caller: streams a WAV, records the reply")
    from telephony.sim.fake_caller import add_arguments as add_call_arguments

    add_call_arguments(p)
    p.set_defaults(func=_call)

    p = sub.add_parser("demo", help="one scripted call end to end, offline, then its timeline")
    p.add_argument(
        "--out",
        default="demo-call.wav",
        help="where to write the call's recording (caller left, agent right)",
    )
    p.add_argument("--wide", action="store_true", help="one line per timeline entry (no wrapping)")
    p.add_argument(
        "--leg",
        choices=("twilio", "openai-sip"),
        default="twilio",
        help="how the call arrives: a Twilio media stream, or OpenAI's SIP interconnect",
    )
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "eval", help="run scenario files (YAML) as simulated calls and check what came of them"
    )
    p.add_argument("files", nargs="+", metavar="FILE.yaml", help="scenario files")
    p.add_argument(
        "--junit",
        default=None,
        metavar="PATH",
        help="write a JUnit XML report there (default: none)",
    )
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "replay",
        help="run a recorded call again against the current code and diff its decisions",
    )
    p.add_argument("call_id", metavar="CALL_ID", help="the call's id (as the console shows it)")
    p.add_argument(
        "--save",
        default=None,
        metavar="PATH",
        help="also write the rebuilt call as an eval scenario file there (default: none)",
    )
    p.add_argument(
        "--database-url",
        default=None,
        metavar="URL",
        help="the database that holds the call, where the replay also runs "
        "(default: DATABASE_URL, else the embedded PostgreSQL)",
    )
    p.set_defaults(func=_replay)

    p = sub.add_parser("dial", help="place an outbound call through the service's API")
    p.add_argument("number", metavar="NUMBER", help="the number to call, E.164 (+15551234567)")
    p.add_argument(
        "--purpose",
        required=True,
        help="what the call is for, in a few words (required: no default)",
    )
    p.add_argument(
        "--operation",
        default=None,
        metavar="ID",
        help="an operation the call is about (default: none)",
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="the service (default: the local one, from HOST and PORT)",
    )
    p.add_argument(
        "--token", default=None, help="an operator's API token (default: VOICE_AGENT_API_TOKEN)"
    )
    p.set_defaults(func=_dial)

    p = sub.add_parser("tools", help="the tool catalog: check it, or print the tools file schema")
    toolsub = p.add_subparsers(dest="tools_command", required=True)
    sp = toolsub.add_parser(
        "check", help="load and check the configured catalog (TOOLS, TOOLS_FILE)"
    )
    sp.set_defaults(func=_tools_check)
    sp = toolsub.add_parser("schema", help="print the JSON schema of a tools file (for editors)")
    sp.set_defaults(func=_tools_schema)
    from app.cli.staff import add_commands as add_staff_commands

    add_staff_commands(sub)

    p = sub.add_parser("sor", help="the demo system of record (restaurant bookings)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8766, help="port to listen on")
    p.add_argument(
        "--database-url",
        default=None,
        help="its database (default: SOR_DATABASE_URL, else DATABASE_URL, else the embedded "
        "PostgreSQL in DATA_DIR)",
    )
    p.set_defaults(func=_sor)

    p = sub.add_parser(
        "cluster",
        help="replicas, workers, nginx and Kamailio on this machine, in the foreground",
    )
    p.add_argument("--dir", default=".cluster", help="logs, configs and endpoints.json")
    p.add_argument("--host", default="127.0.0.1", help="the loopback address every part uses")
    p.add_argument("--http-port", type=_port, default=8080, help="nginx's port")
    p.add_argument("--sip-port", type=_port, default=5060, help="Kamailio's port (UDP and TCP)")
    p.add_argument(
        "--replicas",
        type=_positive,
        default=2,
        help="`serve` replicas (their worker: SIP placings only)",
    )
    p.add_argument("--workers", type=_positive, default=1, help="`worker` processes")
    p.add_argument(
        "--rtp-base",
        type=_port,
        default=20000,
        help="first RTP port; each replica takes the next 500 (0: any free port)",
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="its database (default: DATABASE_URL, else TEST_DATABASE_URL, else an embedded "
        "PostgreSQL in DIR/data)",
    )
    p.add_argument(
        "--simulator", action="store_true", help="calls talk to the local Realtime simulator"
    )
    p.add_argument(
        "--ds-ping-interval",
        type=_positive,
        default=2,
        help="seconds between Kamailio's OPTIONS probes of each replica",
    )
    p.set_defaults(func=_cluster)
    return parser


def _sigterm_as_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (Docker, Kubernetes, systemd) stops a command as Ctrl+C does."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler != signal.SIG_IGN:
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pydantic import ValidationError

    from app.errors import StartupError
    from app.logging import configure_logging
    from app.settings import get_settings, setting_problems

    # Commands that stop cleanly on their own (serve, worker, simulator) replace this
    # while they run; it covers their start and the commands that do not.
    signal.signal(signal.SIGTERM, _sigterm_as_sigint)
    try:
        settings = get_settings()
        configure_logging(args.log_level or settings.log_level, settings.log_format)
        return int(args.func(args) or 0)
    except StartupError as exc:
        print(f"voice-agent {args.command}: {exc}", file=sys.stderr)
        return exc.exit_status
    except ValidationError as exc:
        if exc.title != "Settings":
            raise
        # Every bad setting at once, one line each, so a user fixes them in one go.
        for problem in setting_problems(exc):
            print(f"voice-agent {args.command}: bad setting: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # tools.catalog is imported by the commands that load a catalog (~1 s of CPU), not
        # by every command: a CatalogError can only come from a process that imported it.
        catalog = sys.modules.get("tools.catalog")
        if catalog is None or not isinstance(exc, catalog.CatalogError):
            raise
        # A catalog that cannot run: one line per problem, no traceback, non-zero exit.
        print(f"voice-agent: refusing to start: {exc}", file=sys.stderr)
        return 2
    finally:
        from app import embedded_db

        embedded_db.stop_all()


if __name__ == "__main__":
    sys.exit(main())
