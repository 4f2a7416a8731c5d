"""SGLang on the pool: ``KvPoolStorage``, a HiCache L3 storage backend (:mod:`.storage`; imports SGLang), its pages
and keys (:mod:`.pages`) and its config (:mod:`.config`: no SGLang import, for ``kvpool sglang-config``).  Runs in
SGLang's scheduler processes, one backend per TP rank."""
