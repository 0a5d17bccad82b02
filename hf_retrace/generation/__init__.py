"""Plugging the drafter into transformers' generate: candidate generator, dispatch, target features."""

from .candidate_generator import ReTraceCandidateGenerator
from .dispatch import attach, detach, install, uninstall

__all__ = ["ReTraceCandidateGenerator", "attach", "detach", "install", "uninstall"]
