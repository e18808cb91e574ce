"""A class embedding with a domain axis: conditioning = class row + domain row.

FedDEO's frozen generator (seed 003) needs a conditioning space in which some point selects
each domain a device may hold, as Stable Diffusion's text space holds "a sketch of" and
"a painting of". :class:`ClassDomainEmbedding` replaces a classifier-free-guidance U-Net's
class embedding (``num_class_embeds = 11``: 10 classes and the null class) with two tables:

- ``weight`` (11, D): the class rows, the null class last (the same name and shape as the
  plain embedding's, so everything that reads the class table still finds it);
- ``domain_weight`` (1 + len(DOMAINS), D): row 0 is the *unspecified* domain, row
  ``1 + k`` is ``shared.data.domains.DOMAINS[k]``.

A label is ``class + 11 * domain_row`` (:func:`encode`): labels 0..10 are the classes and
the null class with the domain unspecified, so a caller that knows nothing of domains (the
evaluator's FID samples, ``ddim_sample``'s default labels) conditions as on a plain
classifier-free-guidance U-Net. The conditioning vector of a label is
``weight[class] + domain_weight[domain_row]``; :meth:`ClassDomainEmbedding.prompt_rows` gives
the 11 rows with the domain unspecified (the class prompts and the null), which FedDEO uses
as its class table, and :meth:`ClassDomainEmbedding.rows` the rows of one domain (the
Oracle's conditioning).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: rows of the class table: Fashion-MNIST's 10 classes and the null class
CLASS_ROWS = 11
#: the domain row meaning "no domain given"
UNSPECIFIED = 0


class ClassDomainEmbedding(nn.Embedding):
    """Class rows (``weight``) plus domain rows (``domain_weight``); a label encodes both
    (:func:`encode`). An ``nn.Embedding`` so that code reading ``class_embedding.weight``
    finds the class table."""

    def __init__(self, num_domain_rows: int, embedding_dim: int) -> None:
        super().__init__(CLASS_ROWS, embedding_dim)
        if num_domain_rows < 1:
            raise ValueError("a domain axis needs at least the unspecified row")
        self.domain_weight = nn.Parameter(torch.empty(num_domain_rows, embedding_dim))
        nn.init.normal_(self.domain_weight)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        """``weight[label % 11] + domain_weight[label // 11]``."""
        labels = labels.long()
        return F.embedding(labels % CLASS_ROWS, self.weight) + F.embedding(
            labels // CLASS_ROWS, self.domain_weight
        )

    def rows(self, domain_row: int) -> torch.Tensor:
        """The 11 conditioning vectors (classes and null) in domain row ``domain_row``,
        detached."""
        if not 0 <= domain_row < len(self.domain_weight):
            raise ValueError(f"domain row {domain_row} of {len(self.domain_weight)}")
        return (self.weight + self.domain_weight[domain_row]).detach()

    def prompt_rows(self) -> torch.Tensor:
        """The class prompts and the null with the domain unspecified (11, D), detached."""
        return self.rows(UNSPECIFIED)


def encode(classes: torch.Tensor, domain_rows: torch.Tensor | int) -> torch.Tensor:
    """Labels of (class, domain row) pairs: ``class + 11 * domain_row``."""
    return classes.long() + CLASS_ROWS * torch.as_tensor(domain_rows, dtype=torch.long)


def add_domain_axis(unet: nn.Module, num_domain_rows: int) -> nn.Module:
    """``unet`` (a classifier-free-guidance U-Net with 11 class embeddings) with its class
    embedding replaced by a :class:`ClassDomainEmbedding` of ``num_domain_rows`` domain
    rows, on the same device and dtype (the class rows are the old embedding's)."""
    old = getattr(unet, "class_embedding", None)
    if not isinstance(old, nn.Embedding) or old.num_embeddings != CLASS_ROWS:
        raise ValueError(f"a domain axis extends a class embedding of {CLASS_ROWS} rows")
    new = ClassDomainEmbedding(num_domain_rows, old.embedding_dim)
    new = new.to(device=old.weight.device, dtype=old.weight.dtype)
    if old.weight.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(old.weight)
    unet.class_embedding = new
    return unet
