"""The EAGLE-3 drafter: model (`aerie.draft.model`) and its attention (`aerie.draft.attention`), draft
vocabulary (`aerie.draft.vocab`), the SGLang export and its loader (`aerie.draft.export`), and the two
target tensors it borrows (`aerie.draft.target_weights`). Nothing here imports Prefect."""
