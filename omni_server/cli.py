"""`omni-server` command line: serve, stage, check, bench, keys."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage-arg", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="override a stage setting, e.g. 1.max_num_seqs=8 or thinker.devices=1 (repeatable)")


def _port(value: str) -> int:
    port = int(value) if value.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {value!r}")
    return port


def _load(path: str, overrides: list[str], check_names: bool = False):
    from omni_server.config import ConfigError, load_config

    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"error: invalid config\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
    if check_names:
        from omni_server.config.loader import missing_paths
        from omni_server.stage.names import problems

        found = missing_paths(cfg, path) + problems(cfg, path)
        if found:
            print("error: invalid config\n" + "\n".join(found), file=sys.stderr)
            raise SystemExit(2)
    return cfg


def cmd_check(args) -> int:
    cfg = _load(args.config, args.stage_arg, check_names=True)
    # (vLLM's import would log its platform lines to stdout, where check prints its verdict.)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.getLogger("vllm").setLevel(logging.WARNING)  # (its import's platform notes are not check's verdict)
    from omni_server.config.loader import engine_arg_problems

    found = engine_arg_problems(cfg, args.config)
    if found:
        print("error: invalid config\n" + "\n".join(found), file=sys.stderr)
        return 2
    print(f"{args.config}: ok — model {cfg.model!r}, {len(cfg.stages)} stage(s): "
          + ", ".join(f"{s.id}:{s.name}({s.kind})" for s in cfg.stages))
    from pathlib import Path

    from omni_server.orchestrator.launcher import Launcher

    from omni_server.stage.processors import context_notes

    launcher = Launcher(cfg, Path("."))
    for note in launcher.gpu_start_notes() + launcher.host_notes() + context_notes(cfg):
        print(f"note: {note}")
    return 0


def cmd_stage(args) -> int:
    cfg = _load(args.config, args.stage_arg)
    if not 0 <= args.stage < len(cfg.stages):
        print(f"error: {args.config} has no stage {args.stage}", file=sys.stderr)
        return 2
    # vLLM's own log lines name the stage, as ours do: `serve` (and docker-compose's log) mixes
    # every stage's output. (Read when vLLM's logger is first imported, below.)
    os.environ.setdefault("VLLM_LOGGING_PREFIX", f"[{cfg.unit_name((args.stage, args.replica))}] ")
    from omni_server.stage.main import run_stage

    runtime_dir = args.runtime_dir or cfg.runtime_dir
    explicit = all(s.address for s in cfg.stages) and cfg.server.output_address
    if runtime_dir is None and not explicit:
        print("error: --runtime-dir (or runtime_dir in the config) is required unless every stage has an "
              "`address` and server.output_address is set", file=sys.stderr)
        return 2
    try:
        from omni_server.config.loader import missing_paths

        found = missing_paths(cfg, args.config, args.stage)  # (its own model / tokenizer, before any import)
        if found:
            raise SystemExit("; ".join(line.removeprefix(f"{args.config}: ") for line in found))
        run_stage(cfg, args.stage, runtime_dir or "", parent_pid=args.parent_pid, replica=args.replica,
                  hold=args.hold)
    except BaseException as e:
        from omni_server.orchestrator.launcher import failure_note, failure_path

        note = failure_note(e)
        if note and runtime_dir:
            try:
                failure_path(runtime_dir, (args.stage, args.replica)).write_text(note + "\n", encoding="utf-8")
            except OSError:
                pass  # the traceback below still says it
        raise
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_serve(args) -> int:
    started = time.monotonic()  # ("all stages ready in" counts from the command, imports included)
    # Until serve takes the signals over, nothing has started: Ctrl-C or SIGTERM (the terminal's,
    # a supervisor's) during the config's checks and the imports just ends the command, exit 0 as later.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cfg = _load(args.config, args.stage_arg, check_names=True)
        if args.host:
            cfg.server.host = args.host
        if args.port is not None:
            cfg.server.port = args.port
        if args.api_key:
            cfg.server.api_key = args.api_key
        if args.cuda_mps is not None:
            cfg.cuda_mps = {"true": True, "false": False}.get(args.cuda_mps, args.cuda_mps)
        from omni_server.server import serve
        from omni_server.stage.processors import context_notes

        for note in context_notes(cfg):
            logging.getLogger("omni_server.serve").warning("%s", note)
    except KeyboardInterrupt:
        return 0
    return asyncio.run(serve(cfg, external_stages=args.external_stages, started=started))


def cmd_bench(args) -> int:
    import json

    from omni_server.bench import BenchConfig, run_bench

    if args.realtime and (args.speech or args.image or args.video):
        print("error: --realtime sessions take text and --input-audio only; leave out --speech / --image / --video",
              file=sys.stderr)
        return 2
    if args.speech and args.reference:
        print("error: --reference times transformers answering a chat; it has no /v1/audio/speech "
              "counterpart: leave out one of --speech and --reference", file=sys.stderr)
        return 2
    if args.speech and args.shared_prefix_words:
        print("error: --shared-prefix-words opens every chat with one system message; /v1/audio/speech "
              "takes none: leave out one of --speech and --shared-prefix-words", file=sys.stderr)
        return 2
    for flag, value in (("--requests", args.requests), ("--reference-requests", args.reference_requests),
                        ("--concurrency", min(args.concurrency))):
        if value is not None and value < 1:
            print(f"error: {flag} must be at least 1", file=sys.stderr)
            return 2
    image = None
    if args.image:
        w, x, h = args.image.lower().partition("x")
        if not (x and w.isdigit() and h.isdigit() and 0 < int(w) <= 16384 and 0 < int(h) <= 16384):
            print(f"error: --image takes WIDTHxHEIGHT in pixels, each 1 to 16384, e.g. 1280x720 (got {args.image!r})",
                  file=sys.stderr)
            return 2
        image = (int(w), int(h))
    video = None
    if args.video:
        size, colon, seconds = args.video.lower().partition(":")
        w, x, h = size.partition("x")
        try:
            secs = float(seconds)
        except ValueError:
            secs = 0.0
        if not (colon and x and w.isdigit() and h.isdigit() and 0 < int(w) <= 16384 and 0 < int(h) <= 16384
                and 0.5 <= secs <= 3600):
            print("error: --video takes WIDTHxHEIGHT:SECONDS, each side 1 to 16384 pixels, 0.5 to 3600 s, "
                  f"e.g. 1280x720:10 (got {args.video!r})", file=sys.stderr)
            return 2
        video = (int(w), int(h), secs)
    if args.speech and (image or args.input_audio or video):
        print("error: --image, --input-audio and --video go into chats; /v1/audio/speech takes text only",
              file=sys.stderr)
        return 2
    if args.reference and (image or args.input_audio or video):
        print("error: --reference runs text prompts only; leave out --image / --input-audio / --video to compare",
              file=sys.stderr)
        return 2
    if not 0 <= args.input_audio <= 3600:  # (nan fails too)
        print("error: --input-audio must be a number of seconds, 0 (none) to 3600", file=sys.stderr)
        return 2
    if args.request_rate is not None and not args.request_rate > 0:
        print("error: --request-rate must be a positive number of requests per second", file=sys.stderr)
        return 2
    if args.reference:
        from pathlib import Path

        ref = Path(os.path.expanduser(args.reference))
        local = ref.exists() or args.reference.startswith(("/", "~", "./", "../")) or args.reference.count("/") > 1
        if local and not (ref / "config.json").is_file():
            # (checked now: the reference runs after every level)
            print(f"error: --reference {args.reference}: no config.json there (a checkpoint directory, or a hub id)",
                  file=sys.stderr)
            return 2
    base_url = args.base_url.rstrip("/")
    if base_url.endswith("/v1"):  # (the openai client's base_url; bench adds /v1/... itself)
        base_url = base_url[:-len("/v1")]
    cfg = BenchConfig(base_url=base_url, model=args.model, concurrency=args.concurrency,
                      requests_per_level=args.requests, prompt_words=args.prompt_words,
                      max_tokens=args.max_tokens, api_key=args.api_key or os.environ.get("OMNI_SERVER_API_KEY"),
                      audio=args.audio or args.speech, voice=args.voice, speech=args.speech, realtime=args.realtime,
                      reference=args.reference,
                      reference_talker_max_tokens=args.reference_talker_max_tokens,
                      reference_requests=args.reference_requests, request_rate=args.request_rate,
                      shared_prefix_words=args.shared_prefix_words, image=image, input_audio_s=args.input_audio,
                      video=video)
    result = asyncio.run(run_bench(cfg))
    text = json.dumps(result, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    for lv in result["levels"]:
        print(f"c={lv['concurrency']:<3} n={lv['requests']:<4} errors={lv['errors']:<3} "
              f"out tok/s={lv['output_tok_s']}  TTFT p50/p90/p99 ms={lv['ttft_ms']['p50']}/"
              f"{lv['ttft_ms']['p90']}/{lv['ttft_ms']['p99']}  latency p50/p90/p99 ms="
              f"{lv['latency_ms']['p50']}/{lv['latency_ms']['p90']}/{lv['latency_ms']['p99']}"
              + (f"  prompt tokens {lv['prompt_tokens']} ({lv['cached_tokens']} cached)" if lv["prompt_tokens"] else "")
              + (f"  queue wait p50/max ms={lv['queue_wait_ms']['p50']}/{lv['queue_wait_ms']['max']}"
                 if lv["queue_wait_ms"]["max"] else "")
              + (f"  TTFP p50 ms={lv['ttfp_ms']['p50']}  audio s/wall s={lv['audio_s_per_wall_s']}  "
                 f"RTF p50={lv['rtf']['p50']}  stall p90/max ms={lv['stall_ms']['p90']}/{lv['stall_ms']['max']} "
                 f"({lv['stalled_requests']} requests stalled)" if args.audio or args.speech else ""))
        for example in lv.get("error_examples", []):
            print(f"    error: {example}")
        for st in lv.get("stages", []):
            print(f"    stage {st['stage_id']}: {st['steps']} steps, {st['step_ms_mean']} ms/step, busy {st['busy']}, "
                  f"batch {st['batch_mean']}, {st['payload_mb']} MB to stages, {st['backpressure_pauses']} pauses, "
                  f"first output after {st['first_output_ms']} ms"
                  + (f", {st['underruns']} audio underruns ({st['underrun_s']} s)" if st.get("underruns") else ""))
    ref = result.get("reference")
    if ref and ref.get("error"):
        print(f"reference (transformers) failed: {ref['error']}", file=sys.stderr)
        return 1
    if ref:
        print(f"reference (transformers, {ref['device']}): n={ref['requests']} out tok/s={ref['output_tok_s']}  "
              f"audio s/wall s={ref['audio_s_per_wall_s']}  RTF p50={ref['rtf']['p50']}  "
              f"ours/reference per level: {[lv['vs_reference'] for lv in result['levels']]}")
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0


def cmd_keys(args) -> int:
    from omni_server.wire.security import create_keys

    if not args.dir:
        print("error: name the directory for the keys", file=sys.stderr)
        return 2
    try:
        secret = create_keys(args.dir)
    except OSError as e:  # (exists already, or cannot be written)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {secret} (secret, mode 0600) and its public half; set server.curve_keys_dir: {args.dir} "
          "and give every process of the pipeline this directory")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-server", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="start every stage and the OpenAI-compatible HTTP server")
    p.add_argument("config")
    p.add_argument("--host")
    p.add_argument("--port", type=_port)
    p.add_argument("--api-key", help="require this bearer token on /v1/* (or set OMNI_SERVER_API_KEY)")
    p.add_argument("--external-stages", action="store_true",
                   help="do not start stages: connect to stages started separately at their configured addresses")
    p.add_argument("--cuda-mps", choices=["auto", "true", "false"],
                   help="override the config's cuda_mps: serve's own CUDA MPS daemon for stages sharing a GPU")
    _config_args(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("stage", help="run one stage's engine process")
    p.add_argument("--config", required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--replica", type=int, default=0, help="which replica of the stage (see `replicas`)")
    p.add_argument("--runtime-dir", help="directory of the default ipc sockets (set by `serve`)")
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true",
                   help="after start-up imports, wait for a line 'go' on stdin before building the engine")
    _config_args(p)
    p.set_defaults(fn=cmd_stage)

    p = sub.add_parser("check", help="validate a pipeline config")
    p.add_argument("config")
    _config_args(p)
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("keys", help="create the CURVE key that encrypts and authenticates TCP between processes")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_keys)

    p = sub.add_parser("bench", help="load a running server over HTTP and report latency/throughput")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's root URL (a trailing /v1, as the openai client's, is dropped)")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--requests", type=int, help="requests per level (default: max(8, 4 x concurrency))")
    p.add_argument("--prompt-words", type=int, default=75)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--api-key")
    p.add_argument("--output", help="write the JSON result here")
    p.add_argument("--audio", action="store_true", help="ask for speech too: adds TTFP, audio s/wall s, RTF")
    p.add_argument("--speech", action="store_true",
                   help="drive /v1/audio/speech instead of chat (the prompt is spoken): TTFP, RTF, stalls")
    p.add_argument("--realtime", action="store_true",
                   help="drive the Realtime API instead of chat (one WebSocket session a request, the prompt a "
                        "user item, timed from response.create)")
    p.add_argument("--voice")
    p.add_argument("--reference", metavar="CHECKPOINT_DIR",
                   help="also time transformers' pipeline on the same prompts here, and compare")
    p.add_argument("--reference-talker-max-tokens", type=int, default=500,
                   help="the reference talker's codec-token cap (match the server's talker max_tokens)")
    p.add_argument("--reference-requests", type=int, default=4, help="reference requests (one at a time)")
    p.add_argument("--request-rate", type=float, metavar="PER_S",
                   help="send requests as a Poisson process at this rate (the same schedule each run), "
                        "at most --concurrency at once; default: all at once")
    p.add_argument("--shared-prefix-words", type=int, default=0, metavar="N",
                   help="open every chat with the same system message of about N words (prefix caching: "
                        "each level reports prompt and cached tokens)")
    p.add_argument("--image", metavar="WxH",
                   help="every chat also carries a generated PNG of this size, e.g. 1280x720 (different per request)")
    p.add_argument("--video", metavar="WxH:SECONDS",
                   help="every chat also carries a generated MP4 of this size and length at 2 frames a second, "
                        "e.g. 1280x720:10 (different per request)")
    p.add_argument("--input-audio", type=float, default=0.0, metavar="SECONDS",
                   help="every chat also carries a generated WAV clip this long (different per request)")
    p.set_defaults(fn=cmd_bench)

    args = parser.parse_args(argv)
    level = os.environ.get("OMNI_LOG_LEVEL", "INFO").strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise SystemExit(f"OMNI_LOG_LEVEL={os.environ['OMNI_LOG_LEVEL']!r}: expected debug, info, warning, error "
                         f"or critical")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
