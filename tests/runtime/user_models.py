"""Models of a user's own (no FlexPipe layer types) for the public-API tests, importable by
the spawned rank processes and by ``flexpipe run --model user_models:vit_factory``: a ViT-like
model (patch embedding, four ``nn.TransformerEncoderLayer``s, a head; dropout 0) as an
``nn.Sequential`` and as a module with its own ``forward``, an MLP whose first activation
skips over the middle layers to the last (a skip connection across stage boundaries), a
convolutional net whose weights are computed (weight norm), a recurrent net (GRU, LSTM), and a
Hugging Face ``transformers`` GPT-2 causal LM built from a tiny config (nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe

DIM, CLASSES, IMAGE, PATCH = 16, 5, 8, 4


class PatchEmbed(nn.Module):
    """Images (b, 3, 8, 8) -> patch tokens (b, 4, DIM) plus a learned position embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.pos = nn.Parameter(0.1 * torch.randn(1, (IMAGE // PATCH) ** 2, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class Head(nn.Module):
    """Tokens -> class logits (norm, mean over tokens, linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h).mean(dim=1))


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)


def vit_sequential() -> nn.Sequential:
    """The ViT as a chain of six layers (float64)."""
    return nn.Sequential(PatchEmbed(), *(encoder() for _ in range(4)), Head()).double()


class ViT(nn.Module):
    """The same ViT with its own forward (traced at split points such as ``blocks.2``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = PatchEmbed()
        self.blocks = nn.ModuleList(encoder() for _ in range(4))
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class SkipNet(nn.Module):
    """h = act(inp(x)); g = mid layers of h; logits = out(g + h): ``h`` crosses every stage
    boundary between ``inp`` and ``out``."""

    def __init__(self, width: int = 12, mid: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.mid = nn.ModuleList(nn.Linear(width, width) for _ in range(mid))
        self.out = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        g = h
        for layer in self.mid:
            g = torch.tanh(layer(g))
        return self.out(g + h)


class NormedNet(nn.Module):
    """Weights that are computed, not parameters: weight norm on the convolutions (a
    vocoder's, wav2vec2's positional convolution), a product with a weight the forward
    computes (``gain * w``) and a head under weight norm too; a residual chain over ``mid``."""

    def __init__(self, width: int = 8, mid: int = 3) -> None:
        super().__init__()
        norm = nn.utils.parametrizations.weight_norm
        self.inp = norm(nn.Conv1d(2, width, 3, padding=1))
        self.mid = nn.ModuleList(norm(nn.Conv1d(width, width, 3, padding=1))
                                 for _ in range(mid))
        self.w = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.head = norm(nn.Linear(width, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.view(-1, 2, 3)))
        for conv in self.mid:
            h = h + torch.tanh(conv(h))
        return self.head(h.mean(-1) @ (self.gain[:, None] * self.w))


class RecurrentNet(nn.Module):
    """Each vector as a sequence of its 6 features: a GRU, a bidirectional LSTM, a linear head
    on the last step."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(1, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.lstm = nn.LSTM(width, width, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.unsqueeze(-1)))
        h = self.gru(h)[0]
        h = self.lstm(h)[0]
        return self.out(h[:, -1])  # type: ignore[no-any-return]


def installed(module: str) -> bool:
    """Whether ``module`` imports (an optional library a test case needs)."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True


class RoutedNet(nn.Module):
    """SkipNet's chain with values that need no gradient crossing every boundary: a mask from
    the batch alone and a table from a buffer alone (as a Hugging Face LM's attention mask and
    rotary tables), read by every middle layer; ``h`` is read by the first middle layer only."""

    def __init__(self, width: int = 12, mid: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.mid = nn.ModuleList(nn.Linear(width, width) for _ in range(mid))
        self.out = nn.Linear(width, CLASSES)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x.sum(-1, keepdim=True) > 0).to(x.dtype)
        table = torch.cos(self.scale * x.new_ones(1))  # not folded into a constant
        g = torch.tanh(self.inp(x))
        for layer in self.mid:
            g = torch.tanh(layer(g * table)) * (0.5 + mask)
        return self.out(g)


def images(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, 3, IMAGE, IMAGE, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (n,), generator=gen)


def vectors(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (n,), generator=gen)


def vit_factory() -> flexpipe.UserModel:
    """``flexpipe run --model user_models:vit_factory``: the chain ViT, cross-entropy and an
    example micro-batch of 2 images."""
    return flexpipe.UserModel(vit_sequential(), fn.cross_entropy, images(0, 2))


def skip_factory() -> flexpipe.UserModel:
    """``--model user_models:skip_factory``: SkipNet cut at ``mid.1`` (2 stages; ``h`` crosses
    the boundary as a skip edge)."""
    return flexpipe.UserModel(SkipNet().double(), fn.cross_entropy, vectors(0, 2),
                              split_points=("mid.1",))


def torchvision_vit() -> nn.Module:
    """torchvision's own ``VisionTransformer``, small: 8 x 8 images in patches of 4, four
    encoder layers of width 16 with 2 heads (``nn.MultiheadAttention``), float64."""
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=IMAGE, patch_size=PATCH, num_layers=4, num_heads=2,
                             hidden_dim=DIM, mlp_dim=2 * DIM, num_classes=CLASSES).double()


VOCAB, SEQ = 64, 8


class LogitsOf(nn.Module):
    """A Hugging Face causal LM as ``ids -> logits`` (its forward takes keywords and returns
    a ``ModelOutput``)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def gpt2() -> nn.Module:
    """A 4-layer GPT-2 (hidden 16, 2 heads, dropout 0, untied embeddings) in float64.
    (A Llama fails inside torch 2.13's own pipelining tracer: its rotary-embedding module is
    unflattened without its inputs, so torch's ``pipeline`` cannot run it either.)"""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=4, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=False)
    return LogitsOf(GPT2LMHeadModel(cfg)).double()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every position of the micro-batch."""
    return fn.cross_entropy(logits.flatten(0, 1), target.flatten())


def tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


class DropNet(nn.Module):
    """A model of one's own with dropout as a module (called three times) and as a function:
    its masks must not depend on where it is cut."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.mid = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.out = nn.Linear(12, CLASSES)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.mid:
            h = fn.dropout(self.drop(torch.tanh(layer(h))), 0.2, self.training)
        return self.out(h)  # type: ignore[no-any-return]


def gpt2_dropout() -> nn.Module:
    """A 4-layer GPT-2 with dropout 0.1 everywhere (exported: aten dropouts), tied embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=4, n_head=2,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0,
                     eos_token_id=0)
    return LogitsOf(GPT2LMHeadModel(cfg)).double()


def failing_factory() -> object:
    """``--model user_models:failing_factory``: a factory whose own code fails."""
    raise RuntimeError("the dataset folder is empty")


def auto_skip_factory() -> flexpipe.UserModel:
    """``--model user_models:auto_skip_factory``: SkipNet naming no split points (cut
    automatically)."""
    return flexpipe.UserModel(SkipNet().double(), fn.cross_entropy, vectors(0, 2))


class LinearChain(nn.Module):
    """Plain linear layers: each keeps only its input, for its W too, so two adjacent stages
    on one rank (a V's turn) hand over a tensor both hold after the consumer's B."""

    def __init__(self, width: int = 32, depth: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.mid = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.mid:
            h = layer(h)
        return self.out(h)  # type: ignore[no-any-return]


def chain_factory() -> flexpipe.UserModel:
    """``--model user_models:chain_factory``: the linear chain cut into 4 stages whose middle
    two start with a linear layer reading the previous stage's output."""
    return flexpipe.UserModel(LinearChain().double(), fn.cross_entropy, vectors(0, 4),
                              split_points=("mid.3", "mid.4", "mid.5"))


def normed_factory() -> flexpipe.UserModel:
    """``--model user_models:normed_factory``: the weight-normed convolutional net cut at
    ``mid.1`` (2 stages)."""
    return flexpipe.UserModel(NormedNet().double(), fn.cross_entropy, vectors(0, 4),
                              split_points=("mid.1",))
