"""A training aid that reads each picture straight from the vision tower: the auxiliary heads.

The language model reads a picture through attention, which starts out as an average over its
tokens, so the vision tower gets little signal about what tells shapes apart (a few corner and
edge tokens) until attention has learned where to look. A linear head on the tower's tokens,
max-pooled per picture, learns shape in a few hundred steps. During training these heads predict
each one-shape picture's shape and colour from the tower's output (the merger's), and where its
centre is: a per-token score, softmaxed over the picture's tokens, weighs the tokens' grid
coordinates (a soft argmax), so the tower learns to mark the tokens the shape is on, which is
what the language model's attention has to find. Their loss is added to the answer loss; the
vision tower thus learns the features the language model then only has to read. The heads are
never saved: the checkpoint is a plain Qwen2-VL.
"""

from __future__ import annotations

import torch
from toy_data import COLOURS, SHAPES, Picture

IGNORE = -100
Labels = tuple[int, int, float, float]


def picture_labels(picture: Picture) -> Labels:
    """(shape index, colour index, centre x, centre y as shares of the picture's width and
    height) of a one-shape picture; IGNORE (and centre -1) for any other."""
    if len(picture.shapes) != 1:
        return IGNORE, IGNORE, -1.0, -1.0
    s = picture.shapes[0]
    x, y = s.cx / picture.width, s.cy / picture.height
    return SHAPES.index(s.kind), list(COLOURS).index(s.colour), x, y


def token_centres(h: int, w: int) -> torch.Tensor:
    """[h * w, 2] (x, y) centres of a picture's merged tokens, row by row, as shares."""
    ys, xs = torch.meshgrid((torch.arange(h) + 0.5) / h, (torch.arange(w) + 0.5) / w, indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=1)


class AuxHeads(torch.nn.Module):
    """Shape and colour logits from each picture's merged vision tokens, max-pooled."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.shape = torch.nn.Linear(hidden, len(SHAPES))
        self.colour = torch.nn.Linear(hidden, len(COLOURS))
        self.where = torch.nn.Linear(hidden, 1)
        self.captured: list[torch.Tensor] = []

    def capture(self, module, args, output) -> None:
        """Forward hook on the vision tower's merger: keeps its [tokens, hidden] output."""
        self.captured.append(output)

    def loss(self, grids: torch.Tensor, labels: torch.Tensor, merge: int) -> torch.Tensor:
        """Mean cross-entropy of both heads over the pictures of the last forward pass.
        `grids` [num_images, 3] (t, h, w); `labels` [num_images, 4] as `picture_labels`."""
        (tokens,) = self.captured
        self.captured.clear()
        sizes = (grids.prod(dim=1) // merge**2).tolist()
        per_picture = tokens.split(sizes)
        pooled = torch.stack([t.max(dim=0).values for t in per_picture])  # [N, H]
        centres = []
        for t, (_, h, w) in zip(per_picture, grids.tolist(), strict=True):
            weights = torch.softmax(self.where(t).squeeze(-1), dim=0)  # [tokens]
            centres.append(weights @ token_centres(h // merge, w // merge).to(t))
        scored = labels[:, 0] >= 0
        if not scored.any():
            return tokens.sum() * 0.0
        kinds, colours = labels[scored, 0].long(), labels[scored, 1].long()
        shape = torch.nn.functional.cross_entropy(self.shape(pooled[scored]), kinds)
        colour = torch.nn.functional.cross_entropy(self.colour(pooled[scored]), colours)
        # Squared error in units of a third of the picture: one cell off costs 1.
        where = (9 * (torch.stack(centres)[scored] - labels[scored, 2:]) ** 2).sum(-1).mean()
        return shape + colour + where
