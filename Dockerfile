# One image for every ZML service; compose.yaml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY sdk ./sdk
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
EXPOSE 8080
ENTRYPOINT ["zml"]
CMD ["--help"]
