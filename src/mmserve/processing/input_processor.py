"""Prompt text + images and videos -> ProcessedPrompt: placeholders expanded, identities,
cache, M-RoPE."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmserve.config.multimodal import MultimodalConfig
from mmserve.errors import InvalidRequestError, PromptTooLongError, TooManyItemsError
from mmserve.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_NAMESPACE, Hasher
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.chat import ChatImage, check_user_text, parse_chat_messages
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.item_loading import ImageInput, ItemLoader, VideoInput
from mmserve.processing.item_resolver import ItemResolver
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ProcessingConfig, default_modalities
from mmserve.processing.mrope import get_mrope_positions
from mmserve.processing.placeholders import VisionTokenIds, expand_pads, find_mm_pads
from mmserve.processing.processing_turns import ProcessingTurns
from mmserve.processing.processor_cache import ProcessorCache
from mmserve.processing.prompt_inputs import (
    PromptItem,
    chat_items,
    parse_generate_input,
    with_uuids,
)
from mmserve.processing.remote_planning import (
    RemoteImageLoader,
    RemoteImagePlanning,
    remote_modalities,
)
from mmserve.processing.resent_images import ResentImageEvicted, ResentImages
from mmserve.processing.tokenizer import Tokenizer
from mmserve.processing.video_groups import pad_pieces, plan_stamps, stamp_tokens
from mmserve.processing.video_inputs import (
    DEFAULT_VIDEO_LIMIT,
    largest_item_tokens,
    load_video_config,
    offline_video,
    seconds_per_grid_t,
    split_processor_kwargs,
    video_request_kwargs,
)
from mmserve.processing.video_sampling import VideoConfig


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
        video_config: VideoConfig | None = None,
        tokens_per_second: float | None = None,
        remote_images: RemoteImagePlanning | None = None,
    ) -> None:
        """`tokens_per_second`: Qwen2.5-VL's temporal M-RoPE spacing of videos (None:
        Qwen2-VL, one step per temporal patch). `remote_images`: a disaggregated server's
        images become RemoteItems for the encoder pool (processing/remote_planning.py)."""
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.video_config = video_config or VideoConfig()
        self.tokens_per_second = tokens_per_second
        self.token_ids = token_ids
        self.pad_ids = {"image": token_ids.image_token_id, "video": token_ids.video_token_id}
        self.max_model_len = max_model_len
        # vLLM V1 allows 999 of each modality; a video costs up to the decode ceilings
        # (docs/video.md), so without --limit-mm-per-prompt naming it, one per prompt.
        self.limit_mm_per_prompt = {"video": DEFAULT_VIDEO_LIMIT, **(limit_mm_per_prompt or {})}
        self.cache = cache if cache is not None else ProcessorCache(0)
        self.media_loader = media_loader or MediaLoader()
        hasher = hasher or Hasher()
        # Images resent byte for byte skip their decode while their processed form is cached:
        # a server's (async) path only, and not where nothing is cached or the pool encodes.
        resent = ResentImages(hasher) if self.cache.enabled and not remote_images else None
        self.turns = ProcessingTurns.for_decoding(self.media_loader.config.decode_workers)
        self.items = ItemLoader(
            self.media_loader,
            RemoteImageLoader(self.media_loader, remote_images) if remote_images else None,
            resent,
        )
        modalities = default_modalities(trust_exif_image_id=trust_exif_image_id)
        self.resolver = ItemResolver(
            hasher,
            self.cache,
            model_id=model_id,
            revision=revision,
            trust_exif_image_id=trust_exif_image_id,
            modalities=remote_modalities(modalities) if remote_images else modalities,
            resent=resent,
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
        mm_processor_cache_gb: float = MultimodalConfig.mm_processor_cache_gb,  # the flag's
        hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
        model_id: str | None = None,
        revision: str = "",
        media_loader: MediaLoader | None = None,
        trust_exif_image_id: bool = False,
        tokenizer: Tokenizer | None = None,
        remote_images: RemoteImagePlanning | None = None,
    ) -> InputProcessor:
        """`tokenizer`: one already loaded from `model_dir` (else it is loaded here)."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        text = config.get("text_config") or config
        image_config = ImageProcessorConfig.from_pretrained(model_dir).with_overrides(
            split_processor_kwargs(mm_processor_kwargs)[0]
        )
        vision = config.get("vision_config") or {}
        is_qwen2_5 = config.get("model_type") == "qwen2_5_vl"
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
            video_config=load_video_config(
                model_dir, mm_processor_kwargs, (media_loader or MediaLoader()).config.max_video_fps
            ),
            tokens_per_second=float(vision.get("tokens_per_second", 4)) if is_qwen2_5 else None,
            remote_images=remote_images,
        )

    @property
    def accepts_video(self) -> bool:
        return self.limit_mm_per_prompt.get("video", 0) > 0

    @functools.cached_property
    def max_tokens_per_mm_item(self) -> int:
        """The scheduler's floor for encoder budgets: the largest item any request may send,
        in embeddings. Cached: the video bound tries every frame count (~10-60 ms), and
        nothing it reads changes after construction."""
        return largest_item_tokens(
            self.image_config, self.video_config, self.limit_mm_per_prompt, self.max_model_len
        )

    @property
    def max_patches_per_mm_item(self) -> int:
        """Input patches (what the vision tower's activations scale with) of the largest item."""
        return self.max_tokens_per_mm_item * self.image_config.merge_size**2

    def request_config(
        self, mm_processor_kwargs: Mapping[str, Any] | None, media_io_kwargs: Any = None
    ) -> ProcessingConfig:
        """A request's mm_processor_kwargs (and vLLM's media_io_kwargs, whose video fps and
        num_frames it honours) applied to every modality's configuration."""
        image_kwargs, video_kwargs = split_processor_kwargs(mm_processor_kwargs)
        video_kwargs, params = video_request_kwargs(video_kwargs, media_io_kwargs)
        return ProcessingConfig(
            self.image_config.with_overrides(image_kwargs),
            self.video_config.for_request(video_kwargs, params),
        )

    # ---- entry points -------------------------------------------------------------------

    def process(
        self,
        prompt: str,
        images: Sequence[ImageInput] = (),
        *,
        videos: Sequence[VideoInput] = (),
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        multi_modal_uuids: Sequence[str | None] | None = None,
        video_uuids: Sequence[str | None] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> ProcessedPrompt:
        """Tokenize a prompt that carries one marker per image and per video, and process them.

        `multi_modal_uuids`: the images' uuids (one entry or None per image), `video_uuids`
        the videos'."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        items = [
            PromptItem(modality, data, uuid)
            for modality, given, uuids in (
                ("image", images, multi_modal_uuids),
                ("video", videos, video_uuids),
            )
            for data, uuid in with_uuids(list(given), uuids, modality)
        ]
        return self._process_items(
            prompt, items, self.request_config(mm_processor_kwargs), namespace
        )

    def _process_items(
        self,
        prompt: str,
        items: Sequence[PromptItem],
        cfg: ProcessingConfig,
        namespace: str,
    ) -> ProcessedPrompt:
        """`items` in prompt order (or at least in order within each modality): the k-th
        pad of a modality in the tokenized prompt is that modality's k-th item."""
        counts = {m: sum(it.modality == m for it in items) for m in ("image", "video")}
        self._check_item_limit(counts)
        input_ids = self.tokenizer.encode(prompt)
        pads = find_mm_pads(input_ids, counts, self.pad_ids, self.token_ids)
        queues = {m: iter([it for it in items if it.modality == m]) for m in counts}
        plans = []
        for _, modality in pads:  # prompt order
            item = next(queues[modality])
            plans.append(self.resolver.plan(item.data, item.uuid, cfg, namespace, modality))
        stamps = plan_stamps(plans, self.tokenizer.encode)  # timestamped videos' group texts
        num_tokens = len(input_ids) + sum(p.num_tokens - 1 for p in plans) + stamp_tokens(stamps)
        if num_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt is {num_tokens} tokens ({num_tokens - len(input_ids) + len(plans)} "
                f"of them for {len(plans)} image(s) and video(s)), over --max-model-len "
                f"{self.max_model_len}; shorten the text, send fewer or shorter items, or lower "
                "max_pixels (and for videos fps or max_frames)",
                param="messages",
            )
        resolved = [self.resolver.resolve(plan, cfg, namespace) for plan in plans]
        pieces = pad_pieces(resolved, stamps, self.token_ids, self.resolver.hasher)
        expanded, features, mm_data = expand_pads(
            input_ids, [pos for pos, _ in pads], pieces, self.pad_ids
        )
        videos_done = [f for f in features if f.modality == "video"]
        mrope = get_mrope_positions(
            expanded,
            [f.grid_thw for f in features if f.modality == "image"],
            image_token_id=self.token_ids.image_token_id,
            video_token_id=self.token_ids.video_token_id,
            spatial_merge_size=self.image_config.merge_size,
            video_grid_thw=[f.grid_thw for f in videos_done],
            second_per_grid_ts=[seconds_per_grid_t(mm_data[f.identifier]) for f in videos_done],
            tokens_per_second=self.tokens_per_second,
        )
        return ProcessedPrompt(
            prompt_token_ids=expanded,
            mm_features=features,
            mrope_positions=mrope.positions,
            mrope_position_delta=mrope.delta,
            prompt=prompt,
            mm_data=mm_data,
        )

    def process_generate_input(
        self, prompt: str | Mapping[str, Any], *, namespace: str = DEFAULT_NAMESPACE
    ) -> ProcessedPrompt:
        """Offline `LLM.generate` input: a string or {"prompt", "multi_modal_data", ...}.

        multi_modal_data: {"image": PIL image | bytes | URL | list of them, "video": a file
        path | bytes | URL | frames ([T, H, W, 3] uint8 array, or a list of HxWx3 arrays or
        PIL images) | a list of videos}."""
        if isinstance(prompt, str):
            return self.process(prompt, namespace=namespace)
        given = parse_generate_input(prompt)
        cfg = self.request_config(given.mm_processor_kwargs)
        self._check_item_limit({"image": len(given.images), "video": len(given.videos)})
        budget = self.media_loader.new_decode_budget()
        return self.process(
            given.prompt,
            [self.items.load_image(img, cfg, budget) for img in given.images],
            videos=[offline_video(v, self.media_loader, cfg, budget) for v in given.videos],
            mm_processor_kwargs=given.mm_processor_kwargs,
            multi_modal_uuids=given.uuids.get("image"),
            video_uuids=given.uuids.get("video"),
            namespace=namespace,
        )

    def render_chat_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[ChatImage]]:
        """Chat messages (and the request's tools) -> (prompt text, its image and video parts
        in order)."""
        parsed = parse_chat_messages(messages, self.reserved_tokens, tools=tools)
        prompt = self.tokenizer.apply_chat_template(
            parsed.messages,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
        )
        return prompt, parsed.images

    def process_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        media_io_kwargs: Mapping[str, Any] | None = None,
        **render: Any,
    ) -> ProcessedPrompt:
        """Offline `LLM.chat` (and any sync caller): render, load media, process. `render`:
        `render_chat_parts`' keywords (add_generation_prompt, chat_template_kwargs, ...)."""
        prompt, parts = self._render_checked(messages, **render)
        cfg = self.request_config(mm_processor_kwargs, media_io_kwargs)
        budget = self.media_loader.new_decode_budget()
        loaded = [self.items.load_part(part, cfg, budget) for part in parts]
        return self._process_items(prompt, chat_items(parts, loaded), cfg, namespace)

    async def aprocess_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        media_io_kwargs: Mapping[str, Any] | None = None,
        **render: Any,
    ) -> ProcessedPrompt:
        """HTTP chat: media fetched concurrently, then CPU work off the loop in the request's
        turn (processing_turns.py). `render`: `render_chat_parts`' keywords."""
        prompt, parts = self._render_checked(messages, **render)
        # a bad kwarg fails before any fetch
        cfg = self.request_config(mm_processor_kwargs, media_io_kwargs)
        budget = self.media_loader.new_decode_budget()
        reads = await self.items.aread_parts(parts, cfg, budget)
        async with self.turns.turn(part.modality for part in parts):
            loaded = await self.items.adecode_parts(parts, reads, cfg, budget, namespace)
            try:
                return await asyncio.to_thread(
                    self._process_items, prompt, chat_items(parts, loaded), cfg, namespace
                )
            except ResentImageEvicted:
                # a resent image whose processed form is no longer cached: decode it after all
                loaded = await self.items.adecode_resent(loaded, budget)
                return await asyncio.to_thread(
                    self._process_items, prompt, chat_items(parts, loaded), cfg, namespace
                )

    # ---- helpers ------------------------------------------------------------------------

    def _render_checked(
        self, messages: Sequence[Mapping[str, Any]], **render: Any
    ) -> tuple[str, list[ChatImage]]:
        """render_chat_parts, then the item limits (before any media is fetched)."""
        prompt, parts = self.render_chat_parts(messages, **render)
        counts = {"image": 0, "video": 0}
        for part in parts:
            counts[part.modality] += 1
        self._check_item_limit(counts)
        return prompt, parts

    def _check_item_limit(self, counts: Mapping[str, int]) -> None:
        for modality, count in counts.items():
            limit = self.limit_mm_per_prompt.get(modality)
            if limit is not None and count > limit:
                raise TooManyItemsError(
                    f"the prompt has {count} {modality}s, over --limit-mm-per-prompt "
                    f'{{"{modality}": {limit}}}; send at most {limit} {modality}s per request'
                    + ("" if limit else f", or start the server with a {modality} limit"),
                    param="messages",
                )

    def check_prompt_text(self, text: str) -> None:
        """Refuse raw text (e.g. /v1/completions) that spells a vision token without an item."""
        check_user_text(text, self.reserved_tokens, "prompt")
