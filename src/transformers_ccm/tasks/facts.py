"""Personal facts a user reveals, in many phrasings: shared by the personalization and dialogue families.

Fields: `{v}` is the value, `{a}` the value with its article ("an artist"). Every sentence has paraphrases
for seen wordings and others kept for unseen wordings (see `wordings.Phrasings`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers_ccm.tasks.vocabulary import Split, with_article, words
from transformers_ccm.tasks.wordings import Phrasings


@dataclass(frozen=True)
class Fact:
    """One kind of personal fact and the ways it is said, asked and recalled."""

    pool: str
    statements: Phrasings  # the user says it (first person)
    questions: Phrasings  # the user asks the assistant about it (second person)
    about: Phrasings  # a question about the user (third person), for profiles
    recalls: Phrasings  # the assistant answers the user's question
    acknowledgements: Phrasings  # the assistant's reply when told


FACTS: dict[str, Fact] = {
    "name": Fact(
        "first_name",
        Phrasings(
            (
                "My name is {v}.",
                "I'm {v}, by the way.",
                "Call me {v}.",
                "People call me {v}.",
                "{v} here, back with another question.",
                "Everyone at home calls me {v}, so you can too.",
                "Hi, I'm {v}.",
                "This is {v} writing.",
                "My friends know me as {v}.",
                "I go by {v}.",
                "Just so you know, my name is {v}.",
                "{v} is my name, and I'm new here.",
                "You're chatting with {v} today.",
                "My parents named me {v}.",
                "I'm {v} and I have a question for you.",
                "Hello, {v} speaking.",
                "It's me, {v}.",
                "I'm {v}, nice to meet you.",
                "First things first: I'm {v}.",
                "Let me introduce myself, I'm {v}.",
                "{v} is what everyone calls me.",
                "Name's {v}, and I need some advice.",
                "I'm {v}, so I'll sign off that way.",
                "Good evening, my name is {v} and I'm glad to be here.",
                "I am called {v}.",
                "Sorry, I forgot to introduce myself: {v}.",
            ),
            ("The name's {v}.", "You can call me {v}, that's my name.", "It's {v} again, hope your day is going well."),
        ),
        Phrasings(
            (
                "Do you remember my name?",
                "What is my name?",
                "What did I say my name was?",
                "Can you tell me my name?",
                "Do you know who I am?",
                "What name did I give you?",
                "Do you still know my name?",
                "Would you remind me what my name is?",
                "Have you forgotten my name?",
                "Which name do I go by?",
                "What should you call me?",
                "Do you recall what I'm called?",
            ),
            ("Remind me, what am I called?", "Who am I, by name?"),
        ),
        Phrasings(
            (
                "What is this user's name?",
                "What is the user called?",
                "What's the name of this user?",
                "Which name did this user give?",
                "How does this user introduce themselves?",
                "What name does this user go by?",
                "Who is this user, by name?",
                "Under which name does the user write?",
            ),
            ("By what name does this person go?",),
        ),
        Phrasings(
            (
                "Your name is {v}.",
                "You're {v}.",
                "You told me your name is {v}.",
                "Your name's {v}.",
                "You said your name was {v}.",
                "I remember: you're {v}.",
                "You introduced yourself as {v}.",
                "You go by {v}.",
                "Of course, you're {v}.",
                "Your name, as you told me, is {v}.",
                "You're called {v}.",
                "You introduced yourself as {v}, so that's your name.",
            ),
            ("You are called {v}.",),
        ),
        Phrasings(
            (
                "Nice to meet you, {v}!",
                "Hello {v}, good to meet you.",
                "Hi {v}, how can I help?",
                "Great to meet you, {v}.",
                "Thanks, {v}. What's on your mind?",
                "Hello {v}, welcome!",
                "Lovely name, {v}.",
                "Good to have you here, {v}.",
            ),
            ("Welcome, {v}!",),
        ),
    ),
    "job": Fact(
        "job",
        Phrasings(
            (
                "I work as {a}.",
                "I'm {a} by profession.",
                "My job? I'm {a}.",
                "These days I earn my living as {a}.",
                "After a long shift as {a} I just want to sit down.",
                "Being {a} keeps me busy most weekdays.",
                "I've worked as {a} for three years.",
                "My work as {a} takes up most of my week.",
                "As {a}, I spend a lot of time on my feet.",
                "I got a new job as {a}.",
                "By trade I'm {a}.",
                "I make a living as {a}.",
                "Right now I'm {a}, and I like it.",
                "My boss says I'm the best {v} on the team.",
                "Being {a}, I rarely get a free weekend.",
                "I'm {a}, so my schedule is a bit wild.",
                "After ten years as {a}, I still love it.",
                "My day job? I'm {a}.",
                "I earn my living as {a}.",
                "I've just started working as {a}.",
                "At work I'm {a}, which keeps me busy.",
                "I'm {a} at a small company downtown.",
                "I trained to become {a} and now I am one.",
                "Professionally, I'm {a}.",
                "Most days you'll find me at work, since I'm {a}.",
            ),
            ("For work, I'm {a}.", "I've been {a} for years now.", "Since I work as {a}, my mornings start early."),
        ),
        Phrasings(
            (
                "What do I do for a living?",
                "What is my job?",
                "What did I say I work as?",
                "Do you remember my job?",
                "What kind of work do I do?",
                "What's my occupation?",
                "Which job did I mention?",
                "What is it that I do for work?",
                "Can you recall my profession?",
                "What do I do all day at work?",
                "Which profession did I tell you about?",
                "How do I earn my living?",
            ),
            ("Remind me, what's my profession?", "What do I do for work?"),
        ),
        Phrasings(
            (
                "What does this user work as?",
                "What is this user's job?",
                "What does this user do for a living?",
                "Which occupation does this user have?",
                "What is the user's line of work?",
                "How does this user earn a living?",
                "What is this user's profession?",
                "Which job does the user hold?",
            ),
            ("What is this person's profession?",),
        ),
        Phrasings(
            (
                "You work as {a}.",
                "You're {a}.",
                "Your job is {v}.",
                "You're working as {a}.",
                "You told me you're {a}.",
                "Your occupation is {v}.",
                "You're {a} by profession.",
                "You earn your living as {a}.",
                "Your profession is {v}.",
                "You work as {a}, as you told me.",
                "You said you're {a}.",
            ),
            ("You said you are {a}.",),
        ),
        Phrasings(
            (
                "Being {a} sounds interesting.",
                "{a} - that must keep you busy!",
                "Working as {a} must be demanding.",
                "Oh, you're {a}? That's great.",
                "Being {a} sounds rewarding.",
                "I'd love to hear more about being {a}.",
                "A {v}! That's impressive.",
                "How long have you been {a}?",
            ),
            ("Oh, {a}! How is that?",),
        ),
    ),
    "home": Fact(
        "state",
        Phrasings(
            (
                "I live in {v}.",
                "Home for me is {v}.",
                "I'm based in {v}.",
                "It's been raining all week here in {v}.",
                "I've lived in {v} for a while now.",
                "My apartment is in {v}.",
                "Greetings from {v}, where I live.",
                "Life in {v} suits me.",
                "I call {v} home.",
                "The traffic in {v}, where I live, is terrible today.",
                "These days I live in {v}.",
                "A few years ago I relocated to {v}.",
                "My house is in {v}.",
                "I'm writing from my home in {v}.",
                "Home is {v} for me now.",
                "I settled down in {v}.",
                "We bought a place in {v} last spring.",
                "I rent a small flat in {v}.",
            ),
            ("I moved to {v} and still live there.", "Winters at my place in {v} are long."),
        ),
        Phrasings(
            (
                "Where do I live again?",
                "Which state do I live in?",
                "Where is my home?",
                "Which state did I say I live in?",
                "Do you know where I live?",
                "Can you remember where my home is?",
                "Where did I say I'm living now?",
                "In which state is my home?",
            ),
            ("Remind me where my home is?",),
        ),
        Phrasings(
            (
                "In which state does this user live?",
                "Where does this user live?",
                "Which state is this user's home?",
                "Where is this user based?",
                "Where does this user live now?",
                "In which state does the user reside?",
                "Where is the user's home?",
            ),
            ("Where is this person's home?",),
        ),
        Phrasings(
            (
                "You live in {v}.",
                "Your home is in {v}.",
                "You're based in {v}.",
                "Home for you is {v}.",
                "You live in {v} now.",
                "Your house is in {v}.",
                "You moved to {v}.",
                "You said you live in {v}.",
            ),
            ("You told me you live in {v}.",),
        ),
        Phrasings(
            (
                "{v} is a lovely place to live.",
                "Oh, {v}! I hear it's nice there.",
                "Living in {v} sounds nice.",
                "Ah, {v}! Great place.",
                "Are you enjoying life in {v}?",
                "{v} must be lovely this time of year.",
                "Oh, {v}! I've heard good things.",
            ),
            ("How do you like {v}?",),
        ),
    ),
    "friend": Fact(
        "first_name",
        Phrasings(
            (
                "My best friend is called {v}.",
                "My closest friend is {v}.",
                "I spent the day with my friend {v}.",
                "I'm having dinner with my friend {v} tonight.",
                "My friend {v} is helping me move next week.",
                "{v}, a friend of mine, just got back from abroad.",
                "My friend {v} and I went hiking yesterday.",
                "I met up with {v}, an old friend, this morning.",
                "{v} is my closest friend.",
                "A friend of mine, {v}, told me about a great cafe.",
                "My good friend {v} says hello.",
                "I'm visiting my friend {v} this weekend.",
                "My buddy {v} lent me a book last week.",
                "Last month my friend {v} gave me some great advice.",
                "{v}, my friend from work, just had a baby.",
                "I owe my friend {v} a phone call.",
                "I had lunch with my friend {v} today.",
                "My friend {v} is coming over tonight.",
                "{v}, a friend of mine, suggested I ask you.",
                "I've known my friend {v} for ages.",
                "My friend {v} and I are planning a trip together.",
                "I was texting my friend {v} earlier.",
                "My oldest friend, {v}, lives nearby.",
                "I'm meeting my friend {v} for coffee later.",
                "Yesterday I helped my friend {v} move house.",
                "My friend {v} just started a new job.",
                "{v} and I have been friends since college.",
                "I called my friend {v} last night.",
            ),
            ("{v} has been my best friend since school.", "I was chatting with my friend {v} about it yesterday."),
        ),
        Phrasings(
            (
                "What is my best friend called?",
                "Who is my best friend?",
                "What was my friend's name?",
                "Do you recall my friend's name?",
                "What's my friend's name again?",
                "Who did I say my friend was?",
                "Can you remember my friend's name?",
                "Which friend of mine did I name?",
                "What's the name of my friend?",
                "Which friend did I talk about?",
                "Do you remember who my friend is?",
                "Who's the friend I told you about?",
                "What was my friend called?",
            ),
            ("Which friend did I tell you about?",),
        ),
        Phrasings(
            (
                "What is the name of this user's friend?",
                "Who is this user's friend?",
                "Which friend does this user mention?",
                "What is this user's friend called?",
                "Which friend's name does the user give?",
                "What's the name of the user's friend?",
            ),
            ("Who is this person's best friend?",),
        ),
        Phrasings(
            (
                "Your best friend is called {v}.",
                "Your friend is {v}.",
                "Your friend's name is {v}.",
                "You told me about your friend {v}.",
                "{v} is your friend.",
                "The friend you told me about is {v}.",
                "You said your friend is called {v}.",
                "That would be {v}, your friend.",
            ),
            ("You mentioned your friend {v}.",),
        ),
        Phrasings(
            (
                "{v} sounds like a great friend.",
                "It's good to have a friend like {v}.",
                "{v} sounds lovely.",
                "How nice that you have {v}.",
                "Give {v} my best!",
                "It's great to have a friend like {v}.",
                "Have fun with {v}!",
                "{v} seems like a good friend.",
            ),
            ("Say hi to {v}!",),
        ),
    ),
    "hobby": Fact(
        "hobby",
        Phrasings(
            (
                "In my free time I love {v}.",
                "My favourite hobby is {v}.",
                "I spend most weekends on {v}.",
                "I spent all Sunday on {v}, so I'm a bit tired today.",
                "I really enjoy {v}.",
                "{v} is what I do to unwind.",
                "Every weekend I'm busy with {v}.",
                "I've loved {v} for years.",
                "My hobby? Definitely {v}.",
                "I spend most evenings on {v}.",
                "My favourite way to relax is {v}.",
                "Lately I've gotten really into {v}.",
                "I could spend all day on {v}.",
                "For me, {v} is the best way to spend a day.",
                "I picked up {v} during the holidays.",
            ),
            ("Nothing relaxes me like {v}.", "I was so busy with {v} last night that I forgot to eat."),
        ),
        Phrasings(
            (
                "What is my hobby?",
                "What do I do in my free time?",
                "What do I enjoy doing?",
                "Which hobby did I mention?",
                "What's my favourite pastime?",
                "What's my hobby?",
                "How do I like to spend my free time?",
                "What did I say I do to relax?",
                "Which pastime did I tell you about?",
            ),
            ("What did I say I do for fun?",),
        ),
        Phrasings(
            (
                "What is this user's hobby?",
                "What does this user do for fun?",
                "What does this user enjoy in free time?",
                "Which pastime does this user have?",
                "How does the user relax?",
            ),
            ("How does this person spend free time?",),
        ),
        Phrasings(
            (
                "Your hobby is {v}.",
                "You love {v}.",
                "You enjoy {v}.",
                "Your favourite pastime is {v}.",
                "You relax with {v}.",
                "You spend your free time on {v}.",
            ),
            ("You do {v} for fun.",),
        ),
        Phrasings(
            (
                "{v} sounds like fun!",
                "I can see why you enjoy {v}.",
                "{v} is a great hobby.",
                "Have fun with {v}!",
                "{v} sounds relaxing.",
                "How did you get into {v}?",
                "I'd love to try {v} someday.",
            ),
            ("{v} is a great way to relax.",),
        ),
    ),
    "pet": Fact(
        "pet",
        Phrasings(
            (
                "I have {a} at home.",
                "My pet is {a}.",
                "I just adopted {a}.",
                "My {v} woke me up at five again.",
                "I share my flat with {a}.",
                "My {v} is the best companion.",
                "I take care of {a}.",
                "I've had {a} since last year.",
                "Feeding my {v} is the first thing I do each morning.",
                "I live with {a}.",
                "My {v} keeps me company at home.",
                "Walking my {v} is part of my routine.",
                "I have {a} who sleeps all day.",
                "At home I have {a}.",
                "My {v} woke me up early today.",
            ),
            ("There's {a} waiting for me at home.", "Sorry if I'm slow, my {v} keeps sitting on the keyboard."),
        ),
        Phrasings(
            (
                "What pet do I have?",
                "What kind of pet did I mention?",
                "Which pet did I say I have?",
                "What animal do I keep?",
                "Do you remember my pet?",
                "Do you know what animal I have at home?",
            ),
            ("Which animal lives with me?",),
        ),
        Phrasings(
            (
                "What pet does this user have?",
                "Which animal does this user keep?",
                "Which pet does this user keep?",
                "What animal lives with this user?",
                "Which animal does the user live with?",
                "What kind of pet does the user own?",
            ),
            ("What is this person's pet?",),
        ),
        Phrasings(
            (
                "You have {a}.",
                "Your pet is {a}.",
                "You keep {a} at home.",
                "You told me you have {a}.",
                "You live with {a}.",
                "You mentioned your {v}.",
            ),
            ("You said you keep {a}.",),
        ),
        Phrasings(
            (
                "{a}! How lovely.",
                "Pets like {a} are great company.",
                "Give your {v} a cuddle from me.",
                "{a} at home sounds fun.",
                "Aww, {a}! How sweet.",
                "Your {v} sounds adorable.",
                "How old is your {v}?",
            ),
            ("I'd love to meet your {v}.",),
        ),
    ),
    "language": Fact(
        "language",
        Phrasings(
            (
                "I am learning {v} at the moment.",
                "I practise my {v} every evening.",
                "My {v} homework took me all evening.",
                "I'm trying to learn {v}.",
                "My {v} is getting better every week.",
                "I signed up for a {v} course.",
                "Learning {v} is harder than I thought.",
                "I speak a little {v} now.",
                "I'm studying {v} at night school.",
                "These days I practise {v} every morning.",
                "I began learning {v} this year.",
                "My goal this year is to speak {v}.",
                "I take {v} lessons twice a week.",
                "I'm learning {v} for a trip.",
            ),
            ("I've started {v} lessons.", "I missed my {v} class today because of the rain."),
        ),
        Phrasings(
            (
                "Which language am I learning?",
                "What language am I studying?",
                "What language did I say I'm learning?",
                "Which language am I practising?",
                "What language did I tell you I'm studying?",
                "What am I learning to speak?",
                "Do you remember which language I'm studying?",
            ),
            ("Which lessons did I start?",),
        ),
        Phrasings(
            (
                "Which language is this user learning?",
                "What language does this user study?",
                "Which language is this user studying?",
                "What language is the user learning?",
                "Which language is the user practising?",
                "What language is this user trying to learn?",
            ),
            ("What language is this person practising?",),
        ),
        Phrasings(
            (
                "You are learning {v}.",
                "You're studying {v}.",
                "You're learning {v}.",
                "You said you study {v}.",
                "You're learning to speak {v}.",
                "The language you're learning is {v}.",
                "You practise {v}.",
            ),
            ("You started {v} lessons.",),
        ),
        Phrasings(
            (
                "Good luck with your {v}!",
                "{v} is a rewarding language.",
                "Learning {v} is a great idea.",
                "Keep going with your {v}!",
                "{v} is a beautiful language.",
                "How is your {v} coming along?",
            ),
            ("Enjoy your {v} lessons!",),
        ),
    ),
    "color": Fact(
        "color",
        Phrasings(
            (
                "My favourite colour is {v}.",
                "I painted my room {v} this weekend.",
                "I bought another {v} jumper, since {v} is my favourite colour.",
                "{v} is my favourite colour.",
                "I love anything {v}.",
                "My favourite color has always been {v}.",
                "I chose a {v} car because I love that colour.",
                "I always pick {v} when I can.",
                "{v} is the colour I like most.",
                "I painted my room {v}, my favourite colour.",
                "If I had to choose one colour, it would be {v}.",
                "Most of my clothes are {v}, because I love it.",
            ),
            ("I wear {v} whenever I can.", "Nothing beats {v}, my favourite colour, for a new bike."),
        ),
        Phrasings(
            (
                "What is my favourite colour?",
                "Which colour do I like best?",
                "Which colour is my favourite?",
                "What's my favourite color?",
                "What colour do I like best?",
                "Which colour did I say I love?",
                "Do you remember my favourite colour?",
            ),
            ("What colour did I say I love?",),
        ),
        Phrasings(
            (
                "Which colour does this user like?",
                "What is this user's favourite colour?",
                "What colour does this user love?",
                "Which colour is this user's favourite?",
                "Which colour does the user like most?",
                "Which colour does this user prefer?",
            ),
            ("What colour does this person prefer?",),
        ),
        Phrasings(
            (
                "Your favourite colour is {v}.",
                "You like {v}.",
                "{v} is your favourite colour.",
                "You said you like {v} best.",
                "You love {v}.",
                "You like {v} most.",
                "You said {v} is your favourite.",
            ),
            ("You love the colour {v}.",),
        ),
        Phrasings(
            (
                "{v} is a beautiful colour.",
                "Nice choice, {v}!",
                "{v} is a great colour.",
                "I like {v} too!",
                "{v} is a lovely choice.",
                "Nice, {v} is a cheerful colour.",
                "I can see why you like {v}.",
            ),
            ("{v} suits a room well.",),
        ),
    ),
    "country": Fact(
        "country",
        Phrasings(
            (
                "I grew up in {v}.",
                "I was born in {v}.",
                "Back when I was a kid in {v}, summers felt endless.",
                "I'm originally from {v}.",
                "I spent my childhood in {v}.",
                "{v} is where I was born.",
                "I was raised in {v}.",
                "I come from {v}.",
                "My family is from {v}, where I was born.",
                "Before moving here I lived in {v}, my home country.",
                "I was born and raised in {v}.",
                "As a kid I lived in {v}.",
                "{v} is my home country.",
            ),
            ("My family comes from {v}.", "My grandmother still cooks the dishes we ate growing up in {v}."),
        ),
        Phrasings(
            (
                "Where did I grow up?",
                "Which country am I from?",
                "Which country did I grow up in?",
                "Where was I born?",
                "What country am I originally from?",
                "Do you remember where I was born?",
                "What is my home country?",
            ),
            ("Where is my family from?",),
        ),
        Phrasings(
            (
                "Which country is this user from?",
                "Where did this user grow up?",
                "Where was this user born?",
                "Which country did this user grow up in?",
                "What is this user's home country?",
                "Where does this user come from?",
                "In which country was the user born?",
            ),
            ("What is this person's home country?",),
        ),
        Phrasings(
            (
                "You grew up in {v}.",
                "You are from {v}.",
                "You were born in {v}.",
                "You're originally from {v}.",
                "You come from {v}.",
                "Your home country is {v}.",
                "You were raised in {v}.",
            ),
            ("Your family comes from {v}.",),
        ),
        Phrasings(
            (
                "{v} must have been a nice place to grow up.",
                "I'd love to hear more about {v}.",
                "{v} sounds like a wonderful place to grow up.",
                "Growing up in {v} must have been interesting.",
                "What was it like growing up in {v}?",
                "{v} has a rich culture.",
                "Do you visit {v} often?",
            ),
            ("What do you miss about {v}?",),
        ),
    ),
}

# Small talk: (the user, the assistant's reply); `{v}` is a topic word.
SMALL_TALK = Phrasings(
    (
        ("What do you think about {v}?", "Many people find {v} important."),
        ("I read an article about {v} today.", "That sounds like an interesting read about {v}."),
        ("Can you tell me something about {v}?", "There is a lot to say about {v}."),
        ("The weather is awful today.", "Sorry to hear that; a warm drink might help."),
        ("Any tips for sleeping better?", "A regular bedtime and less screen time usually help."),
        ("I'm thinking of learning to cook.", "Great idea! Start with simple recipes."),
        ("Have you heard anything new about {v}?", "Yes, {v} has been in the news a lot lately."),
        ("I watched a documentary about {v}.", "Documentaries about {v} can be really eye-opening."),
        ("Tell me a fun fact about {v}.", "Here's one: {v} has a surprisingly long history."),
        ("My coffee went cold again.", "That happens to the best of us; a thermos might help."),
        ("I can't decide what to cook tonight.", "A simple pasta is hard to beat."),
        ("Is it normal to feel tired after lunch?", "Yes, many people feel a dip in energy after eating."),
        ("I'm trying to read more these days.", "That's a great habit to build."),
        ("What's a good way to stay focused?", "Short breaks and a tidy desk help many people."),
        ("I'm planning a trip soon.", "Exciting! Planning ahead makes travel much easier."),
        ("My neighbour is so noisy.", "That can be frustrating; a friendly chat sometimes helps."),
        ("Do you know any good podcasts about {v}?", "There are several popular podcasts on {v}."),
        ("I spilled tea on my keyboard.", "Unplug it and let it dry upside down."),
        ("What should I have for breakfast?", "Oats with fruit are quick and filling."),
        ("I keep forgetting to drink water.", "A bottle on your desk can be a good reminder."),
        ("Why is {v} so popular lately?", "{v} gets a lot of attention online these days."),
        ("It finally stopped raining here.", "Great, maybe you can get some fresh air."),
        ("I need a gift idea for a colleague.", "A nice notebook or a plant is usually welcome."),
        ("Explain {v} in one sentence.", "In short, {v} is a broad topic with many sides."),
    ),
    (
        ("Honestly, I can't stop thinking about {v}.", "{v} does seem to be on everyone's mind."),
        ("Got any weekend ideas?", "A walk somewhere new is always a good start."),
    ),
)
# Said around a fact in a natural message: before it, and after it.
OPENERS = Phrasings(
    (
        "Hey!",
        "Good morning.",
        "Long day today.",
        "So, a bit about me:",
        "Thanks for the help earlier.",
        "Hi again.",
        "Hello!",
        "Morning!",
        "Hope you're well.",
        "Busy day.",
        "Okay.",
        "Good evening!",
        "Hi there.",
        "Quick update from me.",
        "Oh, and one more thing.",
        "Sorry for the late reply.",
        "Alright, so.",
    ),
    ("Ugh, what a week.", "Quick thing before I forget:"),
)
CLOSERS = Phrasings(
    (
        "Anyway, how are you?",
        "What about you?",
        "Just thought I'd share.",
        "Anyway, any plans for the weekend?",
        "Just wanted you to know.",
        "How's your day going?",
        "Anyway, that's me.",
        "Talk soon!",
        "Hope that helps you know me better.",
        "Anyway, enough about me.",
        "What do you think?",
        "Have a good one!",
        "That's all for now.",
        "Thought that might be useful.",
    ),
    ("Sorry, I'm rambling.", "Anyway, back to my question."),
)


def fill(sentence: str, value: str) -> str:
    """`sentence` with the value in place, its first letter capitalized."""
    text = sentence.format(v=value, a=with_article(value))
    return text[0].upper() + text[1:]


def draw_facts(rng: random.Random, split: Split, kinds: list[str], count: int) -> dict[str, str]:
    """`count` facts of the given kinds with values from `split`; a friend never shares the user's name."""
    chosen = rng.sample(kinds, min(len(kinds), count))
    values: dict[str, str] = {}
    for kind in chosen:
        values[kind] = _draw_value(rng, split, kind, values)
    return values


def _draw_value(rng: random.Random, split: Split, kind: str, taken: dict[str, str]) -> str:
    """A value of `kind` from `split` that no fact in `taken` holds."""
    return rng.choice([w for w in words(FACTS[kind].pool, split) if w not in taken.values()])


def with_lookalike(rng: random.Random, split: Split, facts: dict[str, str]) -> dict[str, str]:
    """`facts`, or in half of the draws, with one fact swapped for a kind whose values come from the same word list
    as a fact there (a friend's name beside the user's): telling such facts apart is the hard case of recall, which
    uniform draws rarely pose."""
    pools = {FACTS[kind].pool for kind in facts}
    twins = [kind for kind in sorted(FACTS) if kind not in facts and FACTS[kind].pool in pools]
    if not twins or rng.random() < 0.5:
        return facts
    twin = rng.choice(twins)
    droppable = [kind for kind in facts if FACTS[kind].pool != FACTS[twin].pool]
    if not droppable:
        return facts
    dropped = rng.choice(droppable)
    kept = {kind: value for kind, value in facts.items() if kind != dropped}
    return {**kept, twin: _draw_value(rng, split, twin, kept)}
