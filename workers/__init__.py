"""The engine, its model and kernels, and the Ray actors that host it.

Importing this package asks PyTorch to allocate tensors on transparent huge pages
(`THP_MEM_ALLOC_ENABLE=1`, unless the environment already sets it; `0` turns it off). PyTorch
reads the setting at its first tensor allocation, so it applies to a process that imports this
package before allocating any tensor (raypd's commands and worker actors do; the actors also get
it in their runtime environment, `HUGE_PAGES_ENV`). Why: a decode step streams every weight, and
on the 2-core VM these figures were measured on (Linux THP in `madvise` mode, so nothing got huge
pages unless asked), a 256 MiB sum read 29 GB/s on 4 KiB pages and 58 GB/s on 2 MiB pages (page
walks under virtualization), and SmolLM2's decode linears at batch 1 took 6.4 ms a step instead
of 8.4.
"""

import os

HUGE_PAGES_ENV = {"THP_MEM_ALLOC_ENABLE": os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")}
