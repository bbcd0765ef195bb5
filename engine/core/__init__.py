"""The engine core apart from the API process, as vLLM V1's EngineCore / AsyncLLM: the core process runs the
scheduler and the model (``proc``), the API process serves HTTP, tokenizes, detokenizes and checks stop
strings (``client``, ``output``); one message per step crosses between them (``messages``)."""
