"""One tenant scope for every engine: which tenant a request is for, and the chain its chunk keys are in."""

from kvpool.pool.tenants import Scope, Tenants


class TenantScope:
    """A connector's tenants (a tenants file, :mod:`kvpool.pool.tenants`), or none.

    Without tenants every request is served and keyed in the cache identity's own chain (tenant ""); with them a
    request must carry a tenant's API key (vLLM: its ``cache_salt``) and its chunks are keyed in that tenant's chain,
    so that two tenants never share a chunk; a request without one is served without the pool."""

    def __init__(self, tenants: Tenants | None = None) -> None:
        self.tenants = tenants

    @classmethod
    def load(cls, path: str) -> "TenantScope":
        """The tenants of the file at ``path`` ("": none)."""
        return cls(Tenants.load(path) if path else None)

    def tenant_of(self, api_key: str | None) -> str | None:
        """The tenant a request with ``api_key`` is for: "" without tenants, None when tenants are on and the key is no
        tenant's (the pool is then not used for the request)."""
        if self.tenants is None:
            return ""
        return self.tenants.by_api_key(api_key) if api_key and self.tenants.knows(api_key) else None

    def scope(self, tenant: str) -> Scope | None:
        """The chain ``tenant``'s chunks are keyed in (None: the identity's own, for tenant "" or no tenants)."""
        return self.tenants.scope(tenant) if self.tenants is not None and tenant else None
