"""The demo of ``kvpool up``: a long shared document, asked about twice.

The first request prefills the whole prompt and puts its KV into the pool; the second finds the prefix
there and reloads it.  The document is long enough (about 850 tokens with SmolLM2's tokenizer and chat
template) that most of it falls in full 256-token chunks.  :func:`run_demo` asks over a running ``Service``
(``kvpool up`` brings one up with ``kvpool.stack.demo_service``).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.prefill_decode.reference.service import Completion, Service

MODELS = ("smollm2-135m", "tiny-llama")  #: the models the demo runs on (the first is the default)

DOCUMENT = """\
Operations log of the Orion inference cluster, week 47.

Orion serves a chat assistant and a document question-answering product from one disaggregated cluster.
Prefill runs on four nodes named p1 to p4; decode runs on six nodes named d1 to d6. Every node gives part
of its host memory and part of its local NVMe drive to a shared key-value cache pool. The pool keeps the
attention keys and values of prompts that were already processed, cut into chunks of 256 tokens, so that
a prompt that starts like an earlier one does not have to be processed again from the beginning.

Monday. Traffic doubled after the release of the new summarization feature. Most requests attach the same
forty-page product manual in front of a short question, so the first few thousand tokens of many prompts
are identical. The hit rate of the pool rose from 31 percent to 78 percent within an hour, and the median
time to first token fell from 2.9 seconds to 0.4 seconds. The prefill nodes, which had been the
bottleneck, ran at half their usual load for the rest of the day.

Tuesday. Node p3 lost power at 14:02 for eleven minutes. Its lease in etcd expired four seconds later,
and every chunk placement bound to that lease disappeared with it. Requests whose cached prefix had lived
only on p3 were routed to recompute; none of them returned a wrong answer, and the error rate stayed at
zero. The chunks that mattered most had a second replica on p1, so the hit rate dipped only to 69 percent.
When p3 came back it rejoined the pool with an empty cache and filled up again within twenty minutes.

Wednesday. The DRAM tier of d2 crossed its high watermark of 80 percent every few minutes during the
European morning peak. Each time, the least recently used chunks migrated to the NVMe tier until usage
fell to the low watermark of 60 percent. Reading a chunk back from NVMe takes about five times longer
than reading it from DRAM, but it is still about fifteen times faster than recomputing it, so the router
kept choosing to reload. The team raised the DRAM share of d2 from 64 to 96 gigabytes.

Thursday. A misconfigured deployment on d5 started workers with a model whose key-value dtype was
bfloat16 while the rest of the cluster used float16. Because the dtype is part of the cache identity,
those workers computed different chunk keys and simply never hit the pool; nothing was corrupted. The
deployment was rolled back at 10:40 after the hit-rate dashboard for d5 stayed flat at zero.

Friday. The storage team ran the monthly checksum audit. Of 41 million chunks, three failed their crc32c
check, all on one NVMe drive of p2 that later reported media errors. Each corrupt replica was dropped
when it was read, the requests that needed it recomputed the prefix, and the drive was replaced on
Saturday morning. No corrupt bytes ever reached a model.

Capacity at the end of the week: 2.1 terabytes of DRAM and 19 terabytes of NVMe in the pool, holding
about 38 million chunks. the remote tier, which will keep chunks that stayed idle for a day, is
planned for week 49. The on-call engineer for week 48 is Priya Raman; the escalation contact is the
storage team lead, Tomas Lindqvist.
"""

QUESTION = "Which node lost power on Tuesday, for how long, and did any request get a wrong answer?"


def demo_prompt() -> str:
    return f"{DOCUMENT}\nQuestion: {QUESTION}\nAnswer briefly."


@dataclass(frozen=True)
class DemoRun:
    """The same prompt twice: ``cold`` computed its KV, ``warm`` should have reloaded it from the pool."""

    prompt_tokens: int
    cold: "Completion"
    warm: "Completion"
    answer: str  #: the warm answer's text ("" for a model without a tokenizer)

    @property
    def speedup(self) -> float:
        return self.cold.ttft_s / self.warm.ttft_s


def run_demo(service: "Service", max_tokens: int = 32) -> DemoRun:
    """Ask the demo question twice over ``service``: cold TTFT (computed), then warm TTFT (reloaded)."""
    if service.tokenizer is not None:
        tokens = service.tokenize(demo_prompt(), chat=True)
    else:  # a random-weight model: any tokens will do
        tokens = [(i * 7919) % 4096 for i in range(1500)]
    cold = service.complete_sync(tokens, max_tokens)
    warm = service.complete_sync(tokens, max_tokens)
    return DemoRun(len(tokens), cold, warm, service.detokenize(warm.tokens).strip())
