"""Which Realtime endpoint `serve` talks to, decided and checked before it takes a call.

Without OPENAI_API_KEY a deployment that looks like production (an https PUBLIC_BASE_URL,
Twilio credentials of its own, an OpenAI webhook secret) would answer real callers with the
local simulator's synthetic voice: that is refused unless the simulator is asked for
(REALTIME_SIMULATOR=true, `serve --simulator`). With a key, one models request checks it: a key
the API refuses stops the start; an API that does not answer is only a warning, since it may be
briefly unreachable and calls retry their own connect.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai
from openai import AsyncOpenAI

from app.errors import StartupError
from app.settings import Settings

_DEFAULTS = Settings.model_fields


@dataclass(frozen=True, slots=True)
class RealtimePlan:
    """What `serve` does about Realtime: start the in-process simulator, and/or check the key."""

    in_process_simulator: bool
    check_key: bool
    # Why a simulator is used, for the banner ("OPENAI_API_KEY unset", "REALTIME_SIMULATOR").
    reason: str = ""


def production_signs(settings: Settings) -> list[str]:
    """The settings that say real callers reach this service."""
    signs = []
    if settings.public_base_url.startswith("https://"):
        signs.append("PUBLIC_BASE_URL is https")
    if settings.twilio_account_sid != _DEFAULTS["twilio_account_sid"].default:
        signs.append("TWILIO_ACCOUNT_SID is set")
    dev_token = _DEFAULTS["twilio_auth_token"].default
    if settings.twilio_auth_token.get_secret_value() != dev_token.get_secret_value():
        signs.append("TWILIO_AUTH_TOKEN is set")
    if settings.openai_webhook_secret is not None:
        signs.append("OPENAI_WEBHOOK_SECRET is set")
    return signs


def plan_realtime(settings: Settings) -> RealtimePlan:
    """The plan for these settings; StartupError when calls would reach the wrong model."""
    if settings.realtime_simulator:
        return RealtimePlan(
            in_process_simulator=settings.openai_base_url is None,
            check_key=False,
            reason="REALTIME_SIMULATOR=true",
        )
    if settings.openai_api_key is not None:
        return RealtimePlan(in_process_simulator=False, check_key=True)
    if settings.realtime_simulator is False:
        raise StartupError(
            "OPENAI_API_KEY is not set and REALTIME_SIMULATOR=false: set OPENAI_API_KEY to "
            "your OpenAI API key, or unset REALTIME_SIMULATOR to allow the local simulator"
        )
    signs = production_signs(settings)
    if signs:
        raise StartupError(
            f"OPENAI_API_KEY is not set, but {' and '.join(signs)}, so real callers would "
            "talk to the local simulator: set OPENAI_API_KEY to your OpenAI API key, or "
            "REALTIME_SIMULATOR=true (serve --simulator) to use the simulator anyway"
        )
    return RealtimePlan(
        in_process_simulator=settings.openai_base_url is None,
        check_key=False,
        reason="OPENAI_API_KEY unset",
    )


async def check_api_key(settings: Settings) -> str | None:
    """Ask the API for the Realtime model with OPENAI_API_KEY: None when it answers, a warning
    when it cannot be asked; StartupError when it refuses the key (or, at OpenAI itself, does
    not know the model)."""
    assert settings.openai_api_key is not None
    timeout = settings.openai_check_timeout_s
    where = settings.openai_base_url or "the OpenAI API"
    model = settings.openai_realtime_model
    client = AsyncOpenAI(
        api_key=settings.openai_api_key.get_secret_value(),
        base_url=settings.openai_base_url,
        max_retries=0,
        timeout=timeout,
    )
    anyway = "starting anyway; calls fail until it answers"
    try:
        async with asyncio.timeout(timeout + 1):  # the SDK's timeout is per phase
            await client.models.retrieve(model)
    except openai.AuthenticationError:
        raise StartupError(
            f"{where} refused OPENAI_API_KEY (401): set OPENAI_API_KEY to a valid API key "
            "(platform.openai.com/api-keys)"
        ) from None
    except openai.PermissionDeniedError:
        raise StartupError(
            f"{where} refused OPENAI_API_KEY for model {model} (403): use a key of a project "
            "that may use the Realtime API, or another OPENAI_REALTIME_MODEL"
        ) from None
    except openai.NotFoundError:
        message = f"{where} does not know model {model!r} (404)"
        if settings.openai_base_url is None:
            raise StartupError(
                f"{message}: set OPENAI_REALTIME_MODEL to a Realtime model such as gpt-realtime"
            ) from None
        # A stand-in (OPENAI_BASE_URL) may not serve /models at all.
        return f"{message}; if OPENAI_REALTIME_MODEL is right there, ignore this"
    except (openai.APITimeoutError, TimeoutError):
        return (
            f"OPENAI_API_KEY not checked: {where} did not answer within {timeout:g} s "
            f"(OPENAI_CHECK_TIMEOUT_S); {anyway}"
        )
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        return f"OPENAI_API_KEY not checked: cannot reach {where} ({cause}); {anyway}"
    except openai.APIStatusError as exc:
        return f"OPENAI_API_KEY not checked: {where} answered {exc.status_code}; {anyway}"
    finally:
        await client.close()
    return None
