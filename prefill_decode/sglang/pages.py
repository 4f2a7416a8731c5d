"""SGLang's host KV pages as kvpool objects: one pool object per page, its bytes in one order whatever the host
pool's layout, keyed in kvpool's identity-rooted key space.

A page of an MHA host pool (``MHATokenToKVPoolHost``) holds ``page_size`` tokens of every layer the pool covers, K
and V.  The host pool lays it out in one of four ways (``--hicache-mem-layout``); the pool object is the page as
``[2, layers, page_size, kv_heads, head_dim]`` (K then V, layer-major: the order ``layer_first`` and
``page_first_direct`` already keep each half in), so that servers with different host layouts share pages.  A page of
an MLA host pool (``MLATokenToKVPoolHost``) holds one latent row a token and layer (``kv_lora_rank + qk_rope_head_dim``
wide); its pool object is ``[layers, page_size, kv_cache_dim]`` (held here as ``[1, layers, page_size, 1, dim]``: the
MHA shape with one half and one head, so that both kinds take the same views and copies).  Each layout's page is a
strided view of the host buffer (:meth:`PageLayout.view`), checked once against the pointers SGLang's own zero-copy
backends use (``get_page_buffer_meta``).  Where that view lies in long runs of host memory (:meth:`PageLayout.runs`)
a page moves straight between them and the pool; else with one copy each way between the host pool and a staging
buffer; never through a flat page tensor.

Keys: SGLang names a page by a SHA-256 chain value over its tokens (:func:`sglang.srt.mem_cache.utils.get_hash_str`,
64 hex digits; no model, rank or tenant in it).  Its pool key is ``SHA-256(root || "sglang-page" || that value)``,
``root`` being the cache identity's chain root (model, dtype, page size, layers, KV heads and head size, TP rank and
size; for MLA the latent widths and no TP: every rank holds the same latent KV), or a tenant's scope of it: two servers
of one model and shard share pages, and nothing else does."""

import hashlib
import math
from functools import cached_property
from typing import Any

import torch

from kvpool.core.keys import CacheIdentity
from kvpool.errors import ConfigError

#: the host layouts a page view is known for, and how each lays out one page: the page's shape in the host buffer
#: (its flat data page's order too) and the permutation of that shape into the pool object's
#: ``[2, layers, page, heads, dim]``
LAYOUTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "layer_first": ("2,L,P,H,D", (0, 1, 2, 3, 4)),
    "page_first": ("2,P,L,H,D", (0, 2, 1, 3, 4)),
    "page_first_direct": ("2,L,P,H,D", (0, 1, 2, 3, 4)),
    "page_head": ("2,H,P,L,D", (0, 3, 2, 1, 4)),
}
#: the layouts of an MLA host pool whose pages SGLang can point at (``get_page_buffer_meta``); its ``page_unified``
#: cannot, and it has no ``page_head``
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: why a layout is refused, for the ones SGLang has and this backend does not serve (measured with sglang 0.5.23)
REFUSED = {
    "page_first_kv_split": "SGLang builds it only for MLA models on Ascend NPUs (from NPUMLATokenToKVPool's split "
    "buffers, --hicache-io-backend kernel_ascend); no CPU or CUDA host pool has it",
    "page_unified": "SGLang's host pools give no page pointers for it (get_page_buffer_meta: Unsupported layout), "
    "so no zero-copy backend can read its pages",
}
_PAGE_TAG = b"sglang-page"
#: a page moves straight between the pool and its host slots only where its bytes lie in runs at least this long
#: (shorter runs cost more per run in Python than the staging copy they save: page_first's and page_head's are one
#: token's layer or one head)
MIN_RUN = 16 << 10


class PageLayout:
    """One MHA or MLA host pool's pages: their views in the host buffer, their bytes, their pool keys."""

    def __init__(self, host: Any) -> None:
        self.mla = hasattr(host, "kv_lora_rank")  #: an MLA host pool: one latent row a token and layer
        layout = getattr(host, "layout", None)
        known = MLA_LAYOUTS if self.mla else tuple(LAYOUTS)
        if layout not in known or getattr(host, "kv_buffer", None) is None:
            why = f" ({REFUSED[layout]})" if layout in REFUSED else ""
            raise ConfigError(
                f"KvPoolStorage supports {'MLA' if self.mla else 'MHA'} host pools in the layouts {', '.join(known)}; "
                f"this server's is {type(host).__name__} in {layout!r}{why}: start it with --hicache-mem-layout "
                "page_first (or another of those)"
            )
        self.host, self.layout = host, layout
        self.page, self.layers = int(host.page_size), int(host.layer_num)
        if self.mla:  # [1, L, P, 1, D]: the MHA shapes with one half and one head
            self.kv: torch.Tensor = host.kv_buffer.unsqueeze(0)
            self.halves, self.heads, self.dim = 1, 1, int(host.kv_cache_dim)
        else:
            self.kv = host.kv_buffer
            self.halves, self.heads, self.dim = 2, int(host.head_num), int(host.head_dim)
        self.dtype: torch.dtype = host.dtype
        order, self.perm = LAYOUTS[layout]
        sizes = {"2": self.halves, "L": self.layers, "P": self.page, "H": self.heads, "D": self.dim}
        self.host_shape = tuple(sizes[d] for d in order.split(","))
        self.shape = (self.halves, self.layers, self.page, self.heads, self.dim)  #: a pool object, as a tensor
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize  #: a pool object's

    def view(self, start: int) -> torch.Tensor:
        """The page whose first token is host slot ``start``, as a strided view of the host buffer in the pool
        object's order (:attr:`shape`: ``[2, layers, page, heads, dim]``, MLA ``[1, layers, page, 1, dim]``); no copy."""
        if self.layout in ("layer_first", "page_first"):
            tokens = slice(start, start + self.page)
            page = self.kv[:, :, tokens] if self.layout == "layer_first" else self.kv[:, tokens]
        else:
            page = self.kv[:, start // self.page]
        return page.permute(self.perm)

    @cached_property
    def host_bytes(self) -> memoryview:
        """The host buffer's bytes (a view; the buffer is contiguous where :meth:`runs` gives any)."""
        return self.kv.reshape(-1).view(torch.uint8).numpy().data

    def runs(self, page: torch.Tensor, flat: torch.Tensor | None = None) -> list[memoryview] | None:
        """The page ``page`` (a :meth:`view` of the host buffer, or a :meth:`canonical` view of the flat page
        ``flat``) as the contiguous runs of memory its bytes lie in, in its order (no copy); None where they are
        shorter than ``MIN_RUN`` (``page_first``, ``page_head``, small pages: the staging copy is quicker then).
        ``page_first_direct``: its K and its V, 2 runs; ``layer_first``: K and V of each layer, 2 x layers."""
        whole = self.kv if flat is None else flat
        if not whole.is_contiguous() or whole.device.type != "cpu":
            return None
        shape, strides, lead, run = page.shape, page.stride(), page.dim(), 1
        while lead > 0 and strides[lead - 1] == run:  # the trailing dimensions that are contiguous
            lead -= 1
            run *= shape[lead]
        size = page.element_size()
        if run * size < MIN_RUN:
            return None
        data = self.host_bytes if flat is None else flat.reshape(-1).view(torch.uint8).numpy().data
        base = (page.storage_offset() - whole.storage_offset()) * size
        starts = [base]
        for dim in range(lead):  # the leading dimensions, outermost first: the runs' starts in order
            starts = [s + i * strides[dim] * size for s in starts for i in range(shape[dim])]
        return [data[s : s + run * size] for s in starts]

    def canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat data page in the host's order (``get_data_page(i, flat=True)``, the generic path's pages) as a
        view in the pool object's order."""
        return flat.reshape(self.host_shape).permute(self.perm)

    def starts(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The first host slot of each of ``pages`` pages of ``host_indices`` (``pages * page_size`` token slots,
        page-aligned, as SGLang's controller passes them)."""
        if host_indices.numel() != pages * self.page:
            raise ConfigError(
                f"{pages} page keys but {host_indices.numel()} host slots: SGLang passes page_size={self.page} slots "
                "a page"
            )
        return [int(i) for i in host_indices[:: self.page].tolist()]

    def check_pointers(self, meta: Any) -> None:
        """Check :meth:`view` against SGLang's ``get_page_buffer_meta`` (what zero-copy backends read): the first and
        the last page start where SGLang says (MHA: its K and V halves).  ``ConfigError`` if not: this SGLang lays
        pages out otherwise than this backend reads them."""
        pages = int(self.host.size) // self.page
        for page in {0, pages - 1}:
            start = page * self.page
            ptrs, _ = meta(torch.arange(start, start + self.page))
            view = self.view(start)  # layer 0, token 0, head 0 of each half: where the page's halves begin
            ours = [view[h, 0, 0].data_ptr() for h in range(self.halves)]
            theirs = [int(ptr) for ptr in ptrs[: self.halves]]
            if ours != theirs:
                raise ConfigError(
                    f"KvPoolStorage: SGLang's {self.layout} host pool puts page {page} at {theirs}, not where this "
                    f"backend reads it ({ours}): this SGLang version is not supported (pin sglang==0.5.23)"
                )

    def identity(self, model: str, tp_rank: int, tp_size: int, first_layer: int) -> CacheIdentity:
        """What two servers must agree on to share pages (the host layout is not part of it; with MLA neither is the
        TP rank or size: every rank holds the same latent KV, and one copy serves them all)."""
        if self.mla:
            host = self.host
            layout = (
                f"sglang-mla:[L,P,D] L={self.layers} from layer {first_layer} kv_lora_rank={host.kv_lora_rank} "
                f"rope_dim={host.qk_rope_head_dim} dim={self.dim}"
            )
            tp_rank, tp_size = 0, 1
        else:
            layout = (
                f"sglang-mha:[2,L,P,H,D] L={self.layers} from layer {first_layer} kv_heads={self.heads} "
                f"head_dim={self.dim}"
            )
        return CacheIdentity(
            model=model,
            kv_dtype=str(self.dtype).removeprefix("torch."),
            layout=layout,
            chunk_size=self.page,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )


def page_key(root: bytes, page_hash: str) -> bytes:
    """The pool key of the page SGLang names ``page_hash``, in the chain rooted at ``root``."""
    return hashlib.sha256(root + _PAGE_TAG + page_hash.encode()).digest()
