"""``kvpool tenants``: secrets for a tenants file, and a check of one (pool/tenants.py)."""

import typer
from rich.table import Table

from kvpool.cli import root
from kvpool.cli.figures import size

tenants = typer.Typer(help="Tenants: who owns which chunks, their secrets, API keys and quotas.", no_args_is_help=True)
root.app.add_typer(tenants, name="tenants")


@tenants.command("new-secret")
def new_secret() -> None:
    """Print a fresh 32-byte secret (hex): the secret of a tenant, or of a shared namespace, in a tenants file.

    The secret roots the tenant's chunk keys: whoever holds it can compute the tenant's keys, so keep the file (or
    the variable its secret_env names) readable only by the serving front and its workers."""
    from kvpool.pool.tenants import new_secret as make

    typer.echo(make())


@tenants.command("check")
def check(path: str = typer.Argument(..., help="The tenants file (TOML): see kvpool.pool.tenants.")) -> None:
    """Read a tenants file and list its tenants (never their secrets or API keys); exit 1 with what is wrong."""
    from kvpool.pool.tenants import Tenants

    with root.errors():
        found = Tenants.load(path)
    table = Table(title=f"{path}: {len(found.tenants)} tenants, {len(found.shared)} shared namespaces")
    for col in ("tenant", "API keys", "DRAM quota", "NVMe quota", "shared namespaces"):
        table.add_column(col, justify="right" if "quota" in col or col == "API keys" else "left")
    for t in found.tenants.values():
        quotas = [size(n) if n else "none" for n in (t.dram_bytes, t.nvme_bytes)]
        table.add_row(t.name, str(len(t.api_keys)), *quotas, ", ".join(t.shared) or "-")
    root.console.print(table)
