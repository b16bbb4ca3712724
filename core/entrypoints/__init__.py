"""Front ends: the asyncio engine the server uses, the `layerzoo` command, chat requests."""
