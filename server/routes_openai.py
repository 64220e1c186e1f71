"""Placeholder: routes come in the next step."""

from fastapi import APIRouter

router = APIRouter()
