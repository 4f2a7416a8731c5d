"""``kvpool explain``: for each chunk of a prompt, where it is in the pool, or why it is not."""

import json
import re
from collections import Counter
from pathlib import Path

import typer
from rich.table import Table

from kvpool.cli import connect, options, root
from kvpool.core.config import Rule, obey
from kvpool.core.keys import CacheIdentity, token_array
from kvpool.errors import ConfigError
from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.identities import fingerprint

_WHICH_IDENTITY = (
    Rule(
        "either", "--model", "--identity", "a model a client registered an identity for, or an identity's fingerprint"
    ),
)
_PROMPT = (
    Rule("either", "PROMPT", "--tokens", "the prompt as a file or as token ids"),
    Rule("excludes", "PROMPT", "--tokens", "the prompt is one of the two"),
)


def pick_identity(cache: MetadataCache, model: str, identity: str) -> CacheIdentity:
    """The registered identity ``--identity`` names (a fingerprint or its prefix), or the one of ``--model``."""
    records = cache.identities()
    if identity:
        found = [r.identity for name, r in records.items() if name.startswith(identity.lower())]
        if len(found) != 1:
            raise ConfigError(
                f"--identity {identity!r} matches {len(found)} of the {len(records)} registered identities; "
                "kvpool status --wide lists them"
            )
        return found[0]
    obey(_WHICH_IDENTITY, {"--model": model, "--identity": identity})
    found = [r.identity for r in records.values() if r.identity.model == model and r.identity.tp_rank == 0]
    if not found:
        known = ", ".join(sorted({r.identity.model for r in records.values()})) or "none"
        raise ConfigError(f"no client registered an identity for model {model!r} (registered models: {known})")
    if len(found) > 1:
        names = ", ".join(sorted(fingerprint(i) for i in found))
        raise ConfigError(f"model {model!r} has {len(found)} identities ({names}): choose one with --identity")
    return found[0]


def read_tokens(prompt: Path | None, tokens: str, tokenizer: str) -> list[int]:
    """The prompt's token ids: ``--tokens``, or the file (ids, whitespace, comma or JSON list; text with ``--tokenizer``)."""
    obey(_PROMPT, {"PROMPT": prompt, "--tokens": tokens})
    text = tokens if tokens else prompt.read_text() if prompt is not None else ""
    if tokenizer:
        from kvpool.prefill_decode.reference.model import load_tokenizer, tokenize

        return tokenize(load_tokenizer(tokenizer), tokenizer, text)
    if not re.fullmatch(r"[\s\[\],0-9]*", text):
        raise ConfigError(
            "the prompt must be token ids (whitespace, comma or a JSON list); for text, add --tokenizer MODEL"
        )
    return [int(t) for t in token_array([int(t) for t in re.findall(r"\d+", text)], "prompt")]


@root.app.command()
def explain(
    prompt: Path | None = typer.Argument(
        None, exists=True, dir_okay=False, help="A file with the prompt: token ids, or text with --tokenizer."
    ),
    tokens: str = typer.Option("", "--tokens", help="The prompt's token ids, e.g. '1,2,3' (instead of a file)."),
    model: str = typer.Option(
        "", "--model", help="Explain under the cache identity a client registered for this model."
    ),
    identity: str = typer.Option(
        "", "--identity", help="Or under this identity (fingerprint, as kvpool status --wide shows)."
    ),
    tokenizer: str = typer.Option(
        "", "--tokenizer", help="Tokenize a text prompt with this model's tokenizer (smollm2-135m)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per chunk instead of a table."),
    etcd: str | None = options.ETCD,
    cluster: str = options.CLUSTER,
) -> None:
    """For each full chunk of a prompt: where the pool holds it (node, tier), or why not — evicted (from which tier,
    by which policy, when), removed, dropped as corrupt, its node left, held under another cache identity of the
    model, or never stored. Reads etcd only: placements, tombstones (kept an hour), departed nodes, and etcd's
    history for what a departed node held."""
    from kvpool.metadata.misses import explain as explain_chunks

    with root.errors():
        ids = read_tokens(prompt, tokens, tokenizer)
        with connect.running_cache(etcd, cluster, "explain") as cache:
            ident = pick_identity(cache, model, identity)
            rows = explain_chunks(cache, cache.etcd, ident, ids)
        if as_json:
            for row in rows:
                typer.echo(json.dumps(row.as_json()))
            return
        table = Table(
            title=f"{len(ids)} tokens, {len(rows)} full chunks of {ident.chunk_size}, identity {fingerprint(ident)} ({ident.model})"
        )
        for col in ("chunk", "tokens", "status", "where / why"):
            table.add_column(col)
        usable = next((r.index for r in rows if r.cause is not None), len(rows))
        for r in rows:
            status = "[green]held[/]" if r.cause is None else f"[yellow]{r.cause.value}[/]"
            table.add_row(str(r.index), f"{r.first_token}-{r.end_token - 1}", status, r.detail)
        root.console.print(table)
        causes = Counter(r.cause.value for r in rows if r.cause is not None)
        said = ", ".join(f"{n} {c}" for c, n in causes.most_common()) or "none"
        root.console.print(
            f"a lookup reuses the first {usable} chunks ({usable * ident.chunk_size} tokens); missing: {said}"
        )
