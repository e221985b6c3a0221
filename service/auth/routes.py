"""The token API (admin only): list, create, revoke. ``fp8guard token ...`` does the same on the
database directly, for the first admin token and for hosts without one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status

from fp8guard.service.auth.access import AUTH_RESPONSES, AdminAccess, authenticator
from fp8guard.service.auth.tokens import issue_token
from fp8guard.service.deps import StoreDep
from fp8guard.service.schemas import TOKEN_NAME_PATTERN, TokenCreatedOut, TokenIn, TokenOut

__all__ = ["router"]

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], responses=AUTH_RESPONSES)

TokenName = Annotated[str, Path(pattern=TOKEN_NAME_PATTERN, description="the token's name")]


@router.get("", response_model=list[TokenOut], summary="Tokens (never their secrets)")
def list_tokens(store: StoreDep, _: AdminAccess,
                revoked: Annotated[bool, Query(description="include revoked tokens")] = False) -> list[TokenOut]:
    return [TokenOut.of(t) for t in store.tokens(include_revoked=revoked)]


@router.post("", response_model=TokenCreatedOut, status_code=status.HTTP_201_CREATED,
             summary="Create a token; its secret is in this answer only",
             responses={409: {"description": "A live token has this name"}})
def create_token(body: TokenIn, store: StoreDep, _: AdminAccess) -> TokenCreatedOut:
    token, record = issue_token(store, name=body.name, role=body.role, run_prefix=body.run_prefix)
    return TokenCreatedOut(**TokenOut.of(record).model_dump(), token=token)


@router.delete("/{name}", response_model=TokenOut, summary="Revoke a token (and end its browser sessions)",
               responses={404: {"description": "No live token has this name"}})
def revoke_token(name: TokenName, store: StoreDep, request: Request, _: AdminAccess) -> TokenOut:
    record = store.revoke_token(name)
    authenticator(request).forget()  # this process stops honouring it now; others within auth_cache_s
    return TokenOut.of(record)
