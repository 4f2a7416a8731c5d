"""``kvpool keys new PATH``: make or extend a key file for encryption at rest (pool/tiers/crypto.py)."""

import typer

from kvpool.cli import root

keys = typer.Typer(help="Key files for encryption at rest of the NVMe and remote tiers.", no_args_is_help=True)
root.app.add_typer(keys, name="keys")


@keys.command("new")
def new(
    path: str = typer.Argument(..., help="The key file: created (mode 0600) if missing, else a key is appended."),
    key_id: str = typer.Option("", "--id", help="The new key's id (default k-<date>-<6 hex>)."),
) -> None:
    """Add a fresh random AES-256 key to a key file.

    The last key of a file seals new chunks, so adding one also rotates the key: chunks sealed with the earlier
    keys still open while their lines stay.  Point PoolConfig.encryption / RemoteConfig.encryption (key_file) at the
    file, at the same path on every node and client.  The key itself is never printed."""
    from kvpool.pool.tiers.crypto import new_key

    with root.errors():
        made = new_key(path, key_id)
    root.console.print(f"key {made} added to {path}; it seals new chunks from now on", soft_wrap=True)
