"""The routes of a transfer: how the bytes of its buckets travel, one module per route."""

from ftstate.transport.routes.base import Plan, ReceiveRoute, SendRoute, Transfer

__all__ = ["Plan", "ReceiveRoute", "SendRoute", "Transfer"]
