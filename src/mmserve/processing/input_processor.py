"""Prompt text + images -> ProcessedPrompt: placeholders expanded, identities, cache, M-RoPE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from mmserve.errors import InvalidRequestError, PromptTooLongError, TooManyItemsError
from mmserve.hashing import DEFAULT_NAMESPACE, Hasher
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.chat import check_media_uuid, check_user_text, parse_chat_messages
from mmserve.processing.decode_budget import RequestDecodeBudget
from mmserve.processing.image_processor import ImageProcessorConfig, max_tokens_per_item
from mmserve.processing.item_resolver import ItemResolver
from mmserve.processing.media import MediaLoader
from mmserve.processing.mrope import get_mrope_positions
from mmserve.processing.placeholders import VisionTokenIds, expand_image_pads, find_image_pads
from mmserve.processing.processor_cache import ProcessorCache
from mmserve.processing.tokenizer import Tokenizer

ImageInput = Image.Image | None  # None: a UUID-only reference to an image sent before


class InputProcessor:
    """The CPU stage of every request: offline generate, offline chat and HTTP chat all end here."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_config: ImageProcessorConfig,
        token_ids: VisionTokenIds,
        *,
        max_model_len: int,
        limit_mm_per_prompt: Mapping[str, int] | None = None,
        cache: ProcessorCache | None = None,
        hasher: Hasher | None = None,
        model_id: str = "",
        revision: str = "",
        media_loader: MediaLoader | None = None,
        trust_exif_image_id: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.token_ids = token_ids
        self.max_model_len = max_model_len
        self.limit_mm_per_prompt = dict(limit_mm_per_prompt or {})
        self.cache = cache if cache is not None else ProcessorCache(0)
        self.media_loader = media_loader or MediaLoader()
        self.resolver = ItemResolver(
            hasher or Hasher(),
            self.cache,
            model_id=model_id,
            revision=revision,
            trust_exif_image_id=trust_exif_image_id,
        )
        ids = (
            token_ids.image_token_id,
            token_ids.video_token_id,
            token_ids.vision_start_token_id,
            token_ids.vision_end_token_id,
        )
        names = [tokenizer.id_to_token(i) for i in ids]
        pad = tokenizer.token_to_id("<|vision_pad|>")
        if pad is not None:
            names.append("<|vision_pad|>")
        self.reserved_tokens: tuple[str, ...] = tuple(n for n in names if n)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        max_model_len: int | None = None,
        limit_mm_per_prompt: Mapping[str, int] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        mm_processor_cache_gb: float = 4.0,
        hash_algorithm: str = "blake3",
        model_id: str | None = None,
        revision: str = "",
        media_loader: MediaLoader | None = None,
        trust_exif_image_id: bool = False,
        tokenizer: Tokenizer | None = None,
    ) -> InputProcessor:
        """`tokenizer`: one already loaded from `model_dir` (else it is loaded here)."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        text = config.get("text_config") or config
        image_config = ImageProcessorConfig.from_pretrained(model_dir).with_overrides(
            mm_processor_kwargs
        )
        return cls(
            tokenizer or Tokenizer.from_pretrained(model_dir),
            image_config,
            VisionTokenIds.from_config(config),
            max_model_len=max_model_len or int(text.get("max_position_embeddings", 32768)),
            limit_mm_per_prompt=limit_mm_per_prompt,
            cache=ProcessorCache.from_gb(mm_processor_cache_gb),
            hasher=Hasher(hash_algorithm),
            model_id=model_id or str(model_dir.resolve()),
            revision=revision,
            media_loader=media_loader,
            trust_exif_image_id=trust_exif_image_id,
        )

    @property
    def max_tokens_per_mm_item(self) -> int:
        """The scheduler's floor for encoder budgets (server-wide configuration)."""
        return max_tokens_per_item(self.image_config)

    @property
    def max_patches_per_mm_item(self) -> int:
        """Input patches of the largest item (the floor of the per-step encoder patch budget)."""
        return max_tokens_per_item(self.image_config) * self.image_config.merge_size**2

    # ---- entry points -------------------------------------------------------------------

    def process(
        self,
        prompt: str,
        images: Sequence[ImageInput] = (),
        *,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        multi_modal_uuids: Sequence[str | None] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> ProcessedPrompt:
        """Tokenize a prompt that carries one image marker per image, and process the images."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        images = list(images)
        uuids = list(multi_modal_uuids) if multi_modal_uuids is not None else [None] * len(images)
        if len(uuids) != len(images):
            raise InvalidRequestError(
                f"multi_modal_uuids has {len(uuids)} image entries but {len(images)} images "
                "were given; give one entry (or null) per image",
                param="multi_modal_uuids",
            )
        for i, uuid in enumerate(uuids):
            if uuid is not None:
                check_media_uuid(uuid, f"multi_modal_uuids.image[{i}]", "multi_modal_uuids")
        self._check_item_limit(len(images))
        input_ids = self.tokenizer.encode(prompt)
        pad_positions = find_image_pads(input_ids, len(images), self.token_ids)
        cfg = self.image_config.with_overrides(mm_processor_kwargs)
        plans = [
            self.resolver.plan(img, uuid, cfg, namespace)
            for img, uuid in zip(images, uuids, strict=True)
        ]
        num_tokens = len(input_ids) + sum(p.num_tokens - 1 for p in plans)
        if num_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt is {num_tokens} tokens ({num_tokens - len(input_ids) + len(plans)} "
                f"of them for {len(plans)} image(s)), over --max-model-len {self.max_model_len}; "
                "shorten the text, send fewer images, or lower max_pixels",
                param="messages",
            )
        items = [self.resolver.resolve(plan, cfg, namespace) for plan in plans]
        expanded, features = expand_image_pads(
            input_ids, pad_positions, items, self.token_ids.image_token_id
        )
        mrope = get_mrope_positions(
            expanded,
            [f.grid_thw for f in features],
            image_token_id=self.token_ids.image_token_id,
            video_token_id=self.token_ids.video_token_id,
            spatial_merge_size=self.image_config.merge_size,
        )
        return ProcessedPrompt(
            prompt_token_ids=expanded,
            mm_features=features,
            mrope_positions=mrope.positions,
            mrope_position_delta=mrope.delta,
            prompt=prompt,
        )

    def process_generate_input(
        self, prompt: str | Mapping[str, Any], *, namespace: str = DEFAULT_NAMESPACE
    ) -> ProcessedPrompt:
        """Offline `LLM.generate` input: a string or {"prompt", "multi_modal_data", ...}."""
        if isinstance(prompt, str):
            return self.process(prompt, namespace=namespace)
        unknown = set(prompt) - {
            "prompt",
            "multi_modal_data",
            "mm_processor_kwargs",
            "multi_modal_uuids",
        }
        if unknown:
            raise InvalidRequestError(f"unsupported prompt keys {sorted(unknown)}")
        mm_data = dict(prompt.get("multi_modal_data") or {})
        images = mm_data.pop("image", [])
        if mm_data:
            raise InvalidRequestError(
                f"unsupported modalities {sorted(mm_data)} in multi_modal_data; only 'image'"
            )
        images = [images] if images is None or isinstance(images, Image.Image) else images
        uuids = _offline_uuids(prompt.get("multi_modal_uuids"))
        budget = self.media_loader.new_decode_budget()
        return self.process(
            prompt.get("prompt", ""),
            [self._load_offline(img, budget) for img in images],
            mm_processor_kwargs=prompt.get("mm_processor_kwargs"),
            multi_modal_uuids=uuids,
            namespace=namespace,
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[Any], list[str | None]]:
        """Chat messages -> (prompt text, image sources in order, their uuids)."""
        parsed = parse_chat_messages(messages, self.reserved_tokens)
        prompt = self.tokenizer.apply_chat_template(
            parsed.messages,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=chat_template_kwargs,
        )
        return prompt, [img.source for img in parsed.images], parsed.uuids

    def process_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """Offline `LLM.chat` (and any sync caller): render, load media, process."""
        prompt, sources, uuids = self._render_checked(
            messages, add_generation_prompt, chat_template_kwargs
        )
        budget = self.media_loader.new_decode_budget()
        images = [self._load(src, budget) for src in sources]
        return self.process(
            prompt,
            images,
            mm_processor_kwargs=mm_processor_kwargs,
            multi_modal_uuids=uuids,
            namespace=namespace,
        )

    async def aprocess_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """HTTP chat: media fetched concurrently, CPU work off the event loop."""
        prompt, sources, uuids = self._render_checked(
            messages, add_generation_prompt, chat_template_kwargs
        )

        images = await self._aload_all(sources, self.media_loader.new_decode_budget())
        return await asyncio.to_thread(
            self.process,
            prompt,
            images,
            mm_processor_kwargs=mm_processor_kwargs,
            multi_modal_uuids=uuids,
            namespace=namespace,
        )

    # ---- helpers ------------------------------------------------------------------------

    def _render_checked(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[str, list[Any], list[str | None]]:
        """render_chat, then the item limit (before any media is fetched)."""
        prompt, sources, uuids = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        self._check_item_limit(len(sources))
        return prompt, sources, uuids

    async def _aload_all(
        self, sources: Sequence[Any], budget: RequestDecodeBudget
    ) -> list[ImageInput]:
        """Load every image concurrently; when one fails, stop the others (their fetch slots
        and decode threads serve other requests instead of a request that already failed)."""

        async def load(src: Any) -> ImageInput:
            return None if src is None else await self.media_loader.aload_image(src, budget)

        tasks = [asyncio.ensure_future(load(src)) for src in sources]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def _load(self, source: Any, budget: RequestDecodeBudget) -> ImageInput:
        return None if source is None else self.media_loader.load_image(source, budget)

    def _load_offline(self, image: Any, budget: RequestDecodeBudget) -> ImageInput:
        if image is None or isinstance(image, Image.Image):
            return image  # PIL: hashed as given (mode, size, pixels, EXIF id)
        return self.media_loader.load_image(image, budget)

    def _check_item_limit(self, num_images: int) -> None:
        limit = self.limit_mm_per_prompt.get("image")
        if limit is not None and num_images > limit:
            raise TooManyItemsError(
                f"the prompt has {num_images} images, over --limit-mm-per-prompt "
                f'{{"image": {limit}}}; send at most {limit} images per request',
                param="messages",
            )

    def check_prompt_text(self, text: str) -> None:
        """Refuse raw text (e.g. /v1/completions) that spells a vision token without an image."""
        check_user_text(text, self.reserved_tokens, "prompt")


def _offline_uuids(value: Any) -> list[Any] | None:
    """`multi_modal_uuids` of an offline prompt: {"image": uuid | [uuid | None, ...]}."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - {"image"}:
        raise InvalidRequestError(
            'multi_modal_uuids must look like {"image": ["uuid-1", null]}; only images have uuids',
            param="multi_modal_uuids",
        )
    uuids = value.get("image")
    if uuids is None or isinstance(uuids, str):
        return None if uuids is None else [uuids]
    if not isinstance(uuids, Sequence):
        raise InvalidRequestError(
            'multi_modal_uuids["image"] must be a uuid or a list of uuids (or null)',
            param="multi_modal_uuids",
        )
    return list(uuids)
