"""The sample conversations (every role, tools and tool calls) the SFT tests train on."""

from lmfoundry.data.sample_chats import WEATHER, write_chats

__all__ = ["WEATHER", "write_chats"]
