"""PyAV helpers: read a clip of frames from a video file, count its frames, write MP4s and GIFs.

Frames are uint8 numpy arrays [T, H, W, 3] (RGB) throughout. `av` is imported lazily (it is the optional
`video` extra), so `import opendit.data` works without it. Every container is opened in a `with` block:
PyAV frees a container's FFmpeg buffers only when it is closed, and a data loader that leaks one per clip
grows without bound (benchmarks/video_decode_memory.py checks that host memory stays flat).
"""
import os
from fractions import Fraction

import numpy as np


class VideoReadError(ValueError):
    """A video that cannot give the clip asked for: not decodable, no video stream, or too few frames."""


def require_av():
    """The `av` module, or an ImportError that says how to install it."""
    try:
        import av
    except ImportError as err:
        raise ImportError("video data needs PyAV; install it with `pip install av` "
                          "(or `pip install -e \".[video]\"`)") from err
    return av


def clip_span(num_frames: int, frame_interval: int) -> int:
    """Frames a clip covers in its source: num_frames frames, frame_interval apart."""
    if isinstance(num_frames, bool) or int(num_frames) != num_frames or num_frames < 1:
        raise ValueError(f"num_frames must be a positive int, got {num_frames!r}; pass e.g. --num_frames 16")
    if isinstance(frame_interval, bool) or int(frame_interval) != frame_interval or frame_interval < 1:
        raise ValueError(f"frame_interval must be a positive int, got {frame_interval!r}; 1 takes every frame")
    return (int(num_frames) - 1) * int(frame_interval) + 1


def _video_stream(container, path):
    if not container.streams.video:
        raise VideoReadError(f"{path!r} has no video stream")
    return container.streams.video[0]


def _count_frames(container, stream) -> int:
    """The container's frame count when its header has one (MP4, MOV); else demux the whole stream and
    count packets (WebM / MKV headers carry none), which reads the file but decodes nothing."""
    if stream.frames > 0:
        return stream.frames
    count = sum(1 for packet in container.demux(stream) if packet.size > 0)  # size 0: the flush packet
    # the demux consumed the stream: rewind so a decode can follow in the same container
    container.seek(0, stream=stream, backward=True)
    return count


def video_frame_count(path: str) -> int:
    """Frames in the first video stream of `path` (header count, else one demux pass; no decoding)."""
    return video_geometry(path)[2]


def video_geometry(path: str) -> tuple[int, int, int]:
    """(width, height, frames) of the first video stream of `path`, from its header (frames: else one demux
    pass; nothing decoded)."""
    av = require_av()
    try:
        with av.open(path if hasattr(path, "read") else os.fspath(path)) as container:
            stream = _video_stream(container, path)
            return stream.codec_context.width, stream.codec_context.height, _count_frames(container, stream)
    except av.error.FileNotFoundError:
        raise
    except av.error.FFmpegError as err:
        raise VideoReadError(f"cannot read video {path!r}: {err}") from err


def _decode_from(container, stream, wanted, seek: bool):
    """Decode the frames at the sorted source indices `wanted` -> {index: uint8 [H, W, 3]}.

    seek=True jumps to the key frame at or before wanted[0] and names the frames from there by their
    timestamps (constant frame rate assumed: index = (pts - start) * time_base * rate). Returns None
    when the jump landed after wanted[0] (some demuxers seek imprecisely) so the caller decodes from 0.
    Decoding stops after the last wanted frame.
    """
    first, last, targets = int(wanted[0]), int(wanted[-1]), set(int(i) for i in wanted)
    first_index = 0
    base = stream.start_time or 0
    if seek:
        rate, time_base = Fraction(stream.average_rate), Fraction(stream.time_base)
        container.seek(base + int(first / rate / time_base), stream=stream, backward=True, any_frame=False)
    out = {}
    index = None
    for frame in container.decode(stream):
        if index is None:
            if seek:
                if frame.pts is None:
                    return None
                first_index = round((frame.pts - base) * time_base * rate)
                if first_index > first:
                    return None
            index = first_index
        else:
            index += 1
        if index in targets:
            out[index] = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8, any pixel format converted
        if index >= last:
            break
    return out


def read_clip(path: str, num_frames: int, frame_interval: int = 1, start=None, seed: int = 0) -> np.ndarray:
    """num_frames frames, frame_interval apart, from `path` -> uint8 [num_frames, H, W, 3] (RGB).

    start: the source index of the first frame, or None to draw it uniformly from the valid starts
    (0 .. count - span) by `seed` (same seed, same start; the datasets pass mix_seed(seed, epoch, index)).
    Only the needed frames are decoded: the reader jumps to the key frame before `start` when the
    stream has a frame rate (seeking assumes a constant rate) and stops after the clip's last frame.
    Raises FileNotFoundError for a missing file and VideoReadError (naming the file) for one that cannot
    be decoded or has fewer than (num_frames - 1) * frame_interval + 1 frames.
    """
    av = require_av()
    span = clip_span(num_frames, frame_interval)
    path = path if hasattr(path, "read") else os.fspath(path)  # a file object: a clip from a tar shard or a table
    try:
        with av.open(path) as container:
            stream = _video_stream(container, path)
            count = _count_frames(container, stream)
            if count < span:
                raise VideoReadError(
                    f"{path!r} has {count} frames; {num_frames} frames every {frame_interval} need {span}: "
                    f"use a longer video, fewer --num_frames or a smaller --frame_interval")
            if start is None:
                start = int(np.random.default_rng(seed).integers(count - span + 1))
            elif isinstance(start, bool) or int(start) != start or not 0 <= start <= count - span:
                raise ValueError(f"start {start!r} is outside 0..{count - span}, the valid first frames of a "
                                 f"{span}-frame span in {path!r} ({count} frames)")
            wanted = int(start) + int(frame_interval) * np.arange(num_frames)
            seekable = wanted[0] > 0 and stream.average_rate and stream.time_base
            frames = _decode_from(container, stream, wanted, seek=bool(seekable))
            if frames is None:  # the seek overshot: decode from the beginning, counting frames
                container.seek(0, stream=stream, backward=True)
                frames = _decode_from(container, stream, wanted, seek=False)
    except av.error.FileNotFoundError:
        raise
    except av.error.FFmpegError as err:
        raise VideoReadError(f"cannot decode video {path!r}: {err}") from err
    missing = [int(i) for i in wanted if int(i) not in frames]
    if missing:
        raise VideoReadError(f"{path!r} ended before frame {missing[0]} although its header counts {count} "
                             f"frames; the file is truncated or damaged")
    return np.stack([frames[int(i)] for i in wanted])


def _rgb_frames(frames, path) -> np.ndarray:
    """uint8 [T, H, W], [T, H, W, 1] or [T, H, W, 3] -> [T, H, W, 3] (grey repeated to RGB)."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8:
        raise ValueError(f"frames for {path!r} must be uint8, got {frames.dtype}; convert with "
                         f"((x + 1) * 127.5).round().clip(0, 255).astype(np.uint8) from [-1, 1]")
    if frames.ndim == 3:
        frames = frames[..., None]
    if frames.ndim != 4 or frames.shape[-1] not in (1, 3) or frames.shape[0] == 0:
        raise ValueError(f"frames for {path!r} must be [T, H, W, 3] or [T, H, W(, 1)] with T >= 1, "
                         f"got shape {tuple(frames.shape)}")
    return np.repeat(frames, 3, axis=-1) if frames.shape[-1] == 1 else frames


def default_mp4_codec() -> str:
    """'libx264' (H.264, plays everywhere) when this FFmpeg build has the encoder, else 'mpeg4'."""
    av = require_av()
    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except av.codec.codec.UnknownCodecError:
        return "mpeg4"


def write_mp4(path: str, frames, fps: int = 8, codec=None) -> str:
    """Write uint8 frames [T, H, W, 3] (or grey [T, H, W(, 1)]) to an MP4 at `path`; returns `path`.

    codec None picks `default_mp4_codec()`. Both codecs store yuv420p, which needs even sizes: an odd
    height or width is padded by repeating the last row / column, so the file is at most 1 px larger.
    The file is written under `<path>.partial` and renamed when complete, so a failed write never
    replaces an existing file with a broken one.
    """
    av = require_av()
    path = os.fspath(path)
    frames = _rgb_frames(frames, path)
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        frames = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    codec = codec or default_mp4_codec()
    partial = path + ".partial"
    try:
        with av.open(partial, "w", format="mp4") as container:
            # crf 18: x264's "visually lossless" quality; mpeg4 takes a bit rate instead (2 bits per pixel)
            options = {"crf": "18"} if codec == "libx264" else {}
            stream = container.add_stream(codec, rate=int(fps), options=options)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            if codec != "libx264":
                stream.bit_rate = 2 * stream.width * stream.height * int(fps)
            for array in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():  # flush the encoder's delayed frames
                container.mux(packet)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def write_gif(path: str, frames, fps: int = 8) -> str:
    """Write uint8 frames [T, H, W, 3] (or grey [T, H, W(, 1)]) to a looping GIF via PIL; returns `path`.

    GIFs keep any size and decode everywhere (a README, a browser) at the cost of a 256-colour palette.
    """
    from PIL import Image

    path = os.fspath(path)
    frames = _rgb_frames(frames, path)
    images = [Image.fromarray(array) for array in frames]
    partial = path + ".partial"
    try:
        images[0].save(partial, format="GIF", save_all=True, append_images=images[1:],
                       duration=round(1000 / fps), loop=0)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path
